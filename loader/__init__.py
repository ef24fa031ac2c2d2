"""lum.loader: opens .lumpkg packages and runs them.

Imports only the standard library, numpy, zstandard, ml_dtypes and (lazily, for the CUDA backend)
cuda-python — never the builder, egglog, torch or typer.

    pkg = lum.loader.open("model.lumpkg")
    sess = pkg.session(backend="reference")
    tokens = sess.generate([1, 2, 3], max_new_tokens=8)
"""

from lum.loader.model import BackendUnavailableError, Package, Session, SessionError, open

__all__ = ["open", "Package", "Session", "SessionError", "BackendUnavailableError"]
