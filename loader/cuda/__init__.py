"""lum's CUDA backend (driver API through cuda-python, cuBLASLt through :mod:`lum.loader.cublaslt`).

Imported only when a session asks for ``backend="cuda"`` or ``"auto"``, so ``import lum.loader``
never needs cuda-python. Modules, in dependency order:

* :mod:`~lum.loader.cuda.driver` — checked driver calls and one-resource wrapper classes
* :mod:`~lum.loader.cuda.target` — device/driver vs. package target (pure)
* :mod:`~lum.loader.cuda.plan` — entries flattened into steps with fixed pointers; graph bucket keys (pure)
* :mod:`~lum.loader.cuda.upload` — weights/constants/state layout and the mmap → device upload
* :mod:`~lum.loader.cuda.arrays` — device outputs with ``__cuda_array_interface__`` and DLPack
* :mod:`~lum.loader.cuda.runner` — the session backend tying them together
"""
