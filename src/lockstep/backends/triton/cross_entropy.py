"""Triton cross_entropy: per-row losses from the row's log-sum-exp (`row_lse`); the sum over rows by
the fixed-order `reduce_losses` that every backend shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.fixed_order import accumulate_dtype, reduce_losses, row_scale
from ...registry import register
from ...numerics.second_order import first_order_only
from .common import cast_out, lane_block, row_lse


@triton.jit(do_not_specialize=["V", "ignore_index"])
def cross_entropy_fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, V, ignore_index, BLOCK: tl.constexpr):
    """Program r: loss of row r (0 when its target is ignored) and its log-sum-exp."""
    row = tl.program_id(0)
    lse = row_lse(x_ptr + row * V, V, 1.0, BLOCK)
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    picked = tl.load(x_ptr + row * V + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit(do_not_specialize=["V", "ignore_index"])
def cross_entropy_bwd_kernel(x_ptr, t_ptr, lse_ptr, scale_ptr, dx_ptr, V, ignore_index, BLOCK: tl.constexpr):
    """Program r: d loss / d logits of row r = (softmax - onehot) * scale[r]; zero if ignored."""
    row = tl.program_id(0)
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    scale = tl.load(scale_ptr + row)
    lse = tl.load(lse_ptr + row)
    lanes = tl.arange(0, BLOCK)
    for v0 in range(0, V, BLOCK):
        cols = v0 + lanes
        m = cols < V
        x = tl.load(x_ptr + row * V + cols, mask=m, other=0.0).to(tl.float32)
        d = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * scale
        tl.store(dx_ptr + row * V + cols, cast_out(tl.where(valid, d, 0.0), dx_ptr), mask=m)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction):
        m, v = logits.shape
        acc = accumulate_dtype(logits.dtype)
        loss = torch.empty(m, dtype=acc, device=logits.device)
        lse = torch.empty(m, dtype=acc, device=logits.device)
        if m:
            cross_entropy_fwd_kernel[(m,)](logits, targets, loss, lse, v, ignore_index, BLOCK=lane_block(v))
        valid = targets != ignore_index
        count = valid.sum()
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        # Summed by the portable fixed-order column_sum: the loss vector is tiny.
        return reduce_losses(loss, count, reduction, logits.dtype)

    @staticmethod
    @first_order_only("cross_entropy")
    def backward(ctx, g):
        logits, targets, lse, count = ctx.saved_tensors
        m, v = logits.shape
        acc = lse.dtype
        scale = row_scale(g, ctx.reduction, count, m, acc)
        dx = torch.empty_like(logits)
        if m:
            cross_entropy_bwd_kernel[(m,)](logits, targets, lse, scale, dx, v, ctx.ignore_index, BLOCK=lane_block(v))
        return dx, None, None, None


@register("triton", "cross_entropy")
def cross_entropy(logits, targets, ignore_index, reduction):
    return _CrossEntropy.apply(logits.contiguous(), targets.contiguous(), ignore_index, reduction)
