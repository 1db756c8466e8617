"""Native exp, log and sqrt (kernels.c): one algorithm in the scalar, AVX2 and AVX-512 paths (for
sqrt, the IEEE instruction), so the same bits on every CPU, where torch.exp, torch.log and
torch.sqrt take MKL's vector math for fp32, whose bits follow the CPU's maker and vector unit."""

from __future__ import annotations

import torch
from torch import Tensor

from .build import isa, library

_FUNCTIONS = {"exp": 0, "log": 1, "sqrt": 2}


def _unary(fn: str, x: Tensor, out: Tensor | None = None) -> Tensor:
    """fn(x) elementwise: any float dtype in (computed in fp32: bf16 and fp16 widen exactly), x's
    dtype out, x's shape; into `out` (fp32 on the CPU, x's shape; written in place when contiguous
    and not a shifted view of x) when given."""
    if out is not None and (out.dtype != torch.float32 or out.shape != x.shape or out.device.type != "cpu"):
        raise ValueError(f"out: expected a float32 CPU tensor of shape {tuple(x.shape)}, got {out.dtype} on "
                         f"{out.device} of shape {tuple(out.shape)}")
    xf = x.float().contiguous()
    # The kernel may write over its input element by element (out is x), not over a shifted copy of it.
    shares = out is not None and out.untyped_storage().data_ptr() == xf.untyped_storage().data_ptr()
    direct = out is not None and out.is_contiguous() and (not shares or out.data_ptr() == xf.data_ptr())
    result = out if direct else torch.empty_like(xf)
    if library().ls_unary(xf.data_ptr(), result.data_ptr(), xf.numel(), _FUNCTIONS[fn], isa(),
                          torch.get_num_threads()) != 0:
        raise RuntimeError(f"ls_unary refused {fn} of {xf.numel()} elements")
    if out is None:
        return result.to(x.dtype)
    return out if direct else out.copy_(result)


def exp(x: Tensor) -> Tensor:
    """e^x elementwise, about 1 ulp from the exact value in fp32 (x: any float dtype, same out)."""
    return _unary("exp", x)


def log(x: Tensor) -> Tensor:
    """The natural log elementwise, about 1 ulp in fp32 (x: any float dtype, same out)."""
    return _unary("log", x)


def sqrt(x: Tensor, out: Tensor | None = None) -> Tensor:
    """The correctly rounded square root elementwise in fp32 (x: any float dtype, same out; or into
    `out`, fp32)."""
    return _unary("sqrt", x, out)
