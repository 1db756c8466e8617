"""Native rms_norm: the forward is one C pass per row (kernels.c, `ls_rms_norm_fwd`) that performs
the portable forward's operations in the portable order, so it gives the portable op's bits on
every CPU (fp32 and bf16 results are stored by the pass itself, fp16 ones rounded by torch); the
backward is the portable one, from the forward's saved rstd. float64 takes the portable op."""

from __future__ import annotations

import torch
from torch import Tensor

from ... import grad_tree
from ...registry import register
from ..portable import rms_norm as portable
from .build import isa, library
from .cpu import native_kernels
from .gemm import DTYPE_CODES, OUT_CODES


def _forward(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    """y in x's dtype and rstd fp32 [rows] of x [rows, H] (contiguous), by the C pass."""
    rows, hidden = x.shape
    y = torch.empty((rows, hidden), dtype=x.dtype if x.dtype in OUT_CODES else torch.float32)
    rstd = torch.empty(rows, dtype=torch.float32)
    w = weight.contiguous()
    status = library().ls_rms_norm_fwd(rows, hidden, x.data_ptr(), w.data_ptr(), eps, offset, y.data_ptr(),
                                       rstd.data_ptr(), DTYPE_CODES[x.dtype], DTYPE_CODES[w.dtype],
                                       OUT_CODES[y.dtype], isa(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"ls_rms_norm_fwd refused x {tuple(x.shape)} {x.dtype}, weight {w.dtype}")
    return y.to(x.dtype), rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
        y, rstd = _forward(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        ctx.use = grad_tree.capture("rms_norm", weight, x.shape[0], ctx.needs_input_grad[1])
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        with native_kernels():
            return portable.rms_norm_backward(ctx, grad_y)


@register("native", "rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    with native_kernels():
        if x.dtype not in DTYPE_CODES or weight.dtype not in DTYPE_CODES or x.dim() != 2:
            return portable.rms_norm(x, weight, eps, offset)
        if not torch.is_grad_enabled():  # no graph to record (the engine's steps): the forward alone
            return _forward(x.contiguous(), weight, eps, offset)[0]
        return _RMSNorm.apply(x.contiguous(), weight, eps, offset)
