"""Native exp and log (kernels.c): one algorithm in the scalar, AVX2 and AVX-512 paths, so the same
bits on every CPU, where torch.exp and torch.log take MKL's vector math for fp32, whose bits follow
the instruction set."""

from __future__ import annotations

import torch
from torch import Tensor

from .build import isa, library

_FUNCTIONS = {"exp": 0, "log": 1}


def _unary(fn: str, x: Tensor) -> Tensor:
    """fn(x) elementwise: any float dtype in (computed in fp32: bf16 and fp16 widen exactly), x's
    dtype out, x's shape."""
    xf = x.float().contiguous()
    out = torch.empty_like(xf)
    if library().ls_unary(xf.data_ptr(), out.data_ptr(), xf.numel(), _FUNCTIONS[fn], isa(),
                          torch.get_num_threads()) != 0:
        raise RuntimeError(f"ls_unary refused {fn} of {xf.numel()} elements")
    return out.to(x.dtype)


def exp(x: Tensor) -> Tensor:
    """e^x elementwise, about 1 ulp from the exact value in fp32 (x: any float dtype, same out)."""
    return _unary("exp", x)


def log(x: Tensor) -> Tensor:
    """The natural log elementwise, about 1 ulp in fp32 (x: any float dtype, same out)."""
    return _unary("log", x)
