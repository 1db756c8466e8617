"""Native rms_norm: the forward is one C pass per row (rows.c, `ls_add_rms_norm_fwd`, which also
takes a decoder layer's residual add before the norm: `add_forward`) and the backward one pass over rows for d x and one over column strips for the weight's gradient
(`ls_rms_norm_bwd`, every unit of a unit tree in the one call); both perform the portable op's
operations in the portable order, so they give its bits on every CPU (fp32 and bf16 results are
stored by the passes themselves, fp16 ones rounded by torch). float64 takes the portable op."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics import grad_tree
from ...registry import register
from ...numerics.second_order import first_order_only
from ..portable import rms_norm as portable
from .build import isa, library
from . import cpu
from .gemm import DTYPE_CODES, OUT_CODES


def _forward(x: Tensor, weight: Tensor, eps: float, offset: float, rstd: bool = True,
             total: Tensor | None = None, delta: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """y in x's dtype and rstd fp32 [rows] (None where not wanted) of x [rows, H] (contiguous), by
    the C pass; with delta (x's shape and dtype, fp32 or bf16, contiguous), of x + delta instead,
    which the pass stores into `total`."""
    rows, hidden = x.shape
    y = torch.empty((rows, hidden), dtype=x.dtype if x.dtype in OUT_CODES else torch.float32)
    rstd = torch.empty(rows, dtype=torch.float32) if rstd else None
    w = weight.contiguous()
    status = library().ls_add_rms_norm_fwd(
        rows, hidden, x.data_ptr(), None if delta is None else delta.data_ptr(), w.data_ptr(), eps, offset,
        None if total is None else total.data_ptr(), y.data_ptr(), None if rstd is None else rstd.data_ptr(),
        DTYPE_CODES[x.dtype], DTYPE_CODES[w.dtype], OUT_CODES[y.dtype], isa(), torch.get_num_threads())
    if status != 0:
        added = "" if delta is None else f" plus delta {tuple(delta.shape)} {delta.dtype}"
        raise RuntimeError(f"ls_add_rms_norm_fwd refused x {tuple(x.shape)} {x.dtype}{added}, weight {w.dtype}")
    return (y if y.dtype == x.dtype else y.to(x.dtype)), rstd


def _backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """d x in x's dtype and the weight's gradient (dense, or None inside a unit tree, whose unit
    partials it hands to the tree) by the C passes, from the forward's saved x, weight and rstd."""
    x, weight, rstd = ctx.saved_tensors
    rows, hidden = x.shape
    g = grad_y.contiguous() if grad_y.dtype in DTYPE_CODES else grad_y.float().contiguous()
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx = torch.empty((rows, hidden), dtype=x.dtype if x.dtype in OUT_CODES else torch.float32) if need_x else None
    use = ctx.use
    per_token = use.per_token if use is not None else 1
    bounds = torch.tensor(use.offsets if use is not None else (0, rows), dtype=torch.int64)
    units = bounds.numel() - 1
    partials = torch.empty((units, per_token * hidden), dtype=torch.float32) if need_w else None
    w = weight.contiguous()
    status = library().ls_rms_norm_bwd(
        rows, hidden, x.data_ptr(), w.data_ptr(), g.data_ptr(), rstd.data_ptr(), ctx.offset,
        None if dx is None else dx.data_ptr(), None if partials is None else partials.data_ptr(), bounds.data_ptr(),
        units, per_token, DTYPE_CODES[x.dtype], DTYPE_CODES[w.dtype], DTYPE_CODES[g.dtype],
        OUT_CODES[dx.dtype] if dx is not None else 0, isa(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"ls_rms_norm_bwd refused x {tuple(x.shape)} {x.dtype}, weight {w.dtype}, "
                           f"grad {g.dtype}, {units} units of {per_token} rows per token")
    dw = None
    if need_w:
        # One partial per unit, in unit order: per_unit asks for them in that order.
        shape = (per_token, hidden) if per_token > 1 else (hidden,)
        unit_partials = iter(partials.view((units,) + shape).unbind(0))
        dw = grad_tree.per_unit(use, rows, lambda start, stop: next(unit_partials))
        dw = None if dw is None else dw.to(weight.dtype)
    return (None if dx is None else dx.to(x.dtype)), dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
        y, rstd = _forward(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        ctx.use = grad_tree.capture("rms_norm", weight, x.shape[0], ctx.needs_input_grad[1])
        return y

    @staticmethod
    @first_order_only("rms_norm")
    def backward(ctx, grad_y: Tensor):
        return _backward(ctx, grad_y) + (None, None)


@register("native", "rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    if x.dtype not in DTYPE_CODES or weight.dtype not in DTYPE_CODES or x.dim() != 2:
        return portable.rms_norm(x, weight, eps, offset, kernels=cpu.KERNELS)
    if not torch.is_grad_enabled():  # no graph to record (the engine's steps): the forward alone
        return _forward(x.contiguous(), weight, eps, offset, rstd=False)[0]
    return _RMSNorm.apply(x.contiguous(), weight, eps, offset)


def add_forward(residual: Tensor, delta: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    """(residual + delta, rms_norm of that sum), both [rows, H] in residual's dtype, from residual
    and delta [rows, H] of one dtype: one C pass where that dtype is fp32 or bf16 and both are
    contiguous (the sum as ATen's add rounds it, a NaN as one quiet NaN; then the forward's operations
    on it), else the add and this op. The forward alone: for callers that record no graph."""
    if (residual.dtype in OUT_CODES and delta.dtype == residual.dtype and weight.dtype in DTYPE_CODES
            and residual.dim() == 2 and delta.shape == residual.shape and residual.is_contiguous()
            and delta.is_contiguous() and residual.device.type == "cpu" and delta.device.type == "cpu"):
        total = torch.empty_like(residual)
        return total, _forward(residual, weight, eps, offset, rstd=False, total=total, delta=delta)[0]
    total = residual + delta
    return total, rms_norm(total, weight, eps, offset)


# ops.add_rms_norm's form of this backend: a decoder layer's residual add and next RMSNorm in one pass.
rms_norm.add = add_forward
