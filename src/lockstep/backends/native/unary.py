"""Native exp, log and sqrt (exp_log.c): one algorithm in the scalar, AVX2 and AVX-512 paths (for
sqrt, the IEEE instruction), so the same bits on every CPU, where torch.exp, torch.log and
torch.sqrt take MKL's vector math, whose bits follow the CPU's maker and vector unit. float64 has
its own algorithms in double precision (float64.c, docs/adr/0027); every other dtype is computed in
fp32."""

from __future__ import annotations

import torch
from torch import Tensor

from .build import isa, library

_FUNCTIONS = {"exp": 0, "log": 1, "sqrt": 2}


def _unary(fn: str, x: Tensor, out: Tensor | None = None) -> Tensor:
    """fn(x) elementwise: float64 in float64, any other float dtype in fp32 (bf16 and fp16 widen
    exactly); x's dtype out, x's shape; into `out` (a CPU tensor of x's shape in that computing
    dtype; written in place when contiguous and not a shifted view of x) when given."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    if out is not None and (out.dtype != work or out.shape != x.shape or out.device.type != "cpu"):
        raise ValueError(f"out: expected a {str(work).removeprefix('torch.')} CPU tensor of shape {tuple(x.shape)}, "
                         f"got {out.dtype} on {out.device} of shape {tuple(out.shape)}")
    xf = x.to(work).contiguous()
    # The kernel may write over its input element by element (out is x), not over a shifted copy of it.
    shares = out is not None and out.untyped_storage().data_ptr() == xf.untyped_storage().data_ptr()
    direct = out is not None and out.is_contiguous() and (not shares or out.data_ptr() == xf.data_ptr())
    result = out if direct else torch.empty_like(xf)
    name = "ls_unary_f64" if work == torch.float64 else "ls_unary"
    if getattr(library(), name)(xf.data_ptr(), result.data_ptr(), xf.numel(), _FUNCTIONS[fn], isa(),
                                torch.get_num_threads()) != 0:
        raise RuntimeError(f"{name} refused {fn} of {xf.numel()} elements")
    if out is None:
        return result.to(x.dtype)
    return out if direct else out.copy_(result)


def exp(x: Tensor) -> Tensor:
    """e^x elementwise, within about 1 ulp of the exact value in fp32 and in float64 (x: any float
    dtype, same out)."""
    return _unary("exp", x)


def log(x: Tensor) -> Tensor:
    """The natural log elementwise, about 1 ulp in fp32 and 2 in float64, where it is
    exact_math.log_float64 bit for bit (x: any float dtype, same out)."""
    return _unary("log", x)


def sqrt(x: Tensor, out: Tensor | None = None) -> Tensor:
    """The correctly rounded square root elementwise in fp32, or in float64 for float64 x (x: any
    float dtype, same out; or into `out`, of that computing dtype)."""
    return _unary("sqrt", x, out)
