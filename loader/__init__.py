"""lum.loader: opens .lumpkg packages and runs them. Imports only the standard library, numpy, zstandard,
ml_dtypes and (lazily) cuda-python — never the builder."""
