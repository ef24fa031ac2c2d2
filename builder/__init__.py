"""lum.builder: frontend, HLIR, partitioning, e-graph search, LLIR and codegen; writes .lumpkg packages."""
