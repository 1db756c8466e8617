"""The Triton backend: the ops of lockstep.ops as Triton kernels, one module per op (GPU; on a
machine without CUDA, under Triton's interpreter, which must be chosen before triton is imported).
The registry imports the op modules after this package (masked_attention's: ADR 0039)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ.get("TRITON_INTERPRET") == "1":
    import numpy
    import triton

    from .. import triton_interpreter_refusal

    _refusal = triton_interpreter_refusal(triton.__version__, numpy.__version__)
    if _refusal:
        raise ImportError(_refusal)

    from .interpreter import cache_dtype_lookup, patch_language_once

    patch_language_once()
    cache_dtype_lookup()
