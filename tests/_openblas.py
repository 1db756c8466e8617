"""The core type numpy's OpenBLAS runs, asked without importing torch or lockstep, so that a process
can ask it alone (OpenBLAS reads OPENBLAS_CORETYPE when numpy loads it)."""

from __future__ import annotations

import ctypes
import os


def openblas_core() -> str | None:
    """The core type numpy's OpenBLAS selected, when numpy's build says."""
    import numpy

    libs = os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs")
    if not os.path.isdir(libs):
        return None
    for name in os.listdir(libs):
        if "openblas" not in name:
            continue
        lib = ctypes.CDLL(os.path.join(libs, name))
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return None
