"""The native backend: lockstep's own CPU kernels (kernels.c and the C files it includes), one
reduction order on every x86 CPU, instruction set and thread count
(docs/adr/0010-native-cpu-backend.md).

The ops are the portable backend's, with their GEMMs (forward, dX, dW, attention's products, the LM
head) and their exp, log and sqrt on the native kernels (cpu.py's KERNELS, which each op passes to
the portable one as its `kernels`). Importing this package builds the kernels (build.py) and raises
ImportError with the reason when they cannot be built or loaded here; the registry then imports its
op modules.
"""

from .build import NativeUnavailable, library

try:
    library()
except NativeUnavailable as e:
    raise ImportError(str(e)) from e

from . import cpu  # noqa: E402, F401  (registers the native kernel set with the registry)
