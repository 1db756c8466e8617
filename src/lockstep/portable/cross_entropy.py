"""Portable cross_entropy: per-row losses as in log_softmax, summed over rows by `column_sum`."""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import register
from .fixed_order import accumulate_dtype, column_sum
from .log_softmax import shifted_and_lse


def reduce_losses(loss: Tensor, count: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """Per-row losses [rows] (0 at ignored rows) -> the op's output: as they are ("none"), their
    fixed-order sum ("sum") or that sum over the non-ignored count ("mean"); shared by every backend."""
    if reduction == "none":
        return loss.to(dtype)
    total = column_sum(loss[:, None])[0]
    if reduction == "mean":
        total = total / count.to(total.dtype)
    return total.to(dtype)


def row_scale(grad: Tensor, reduction: str, count: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """d loss / d (row loss) for each row [rows]: grad itself ("none"), grad / count ("mean") or
    grad ("sum"); shared by every backend's cross_entropy backward."""
    if reduction == "none":
        return grad.contiguous().to(dtype)
    if reduction == "mean":
        return (grad.to(dtype) / count.to(dtype)).expand(rows).contiguous()
    return grad.to(dtype).expand(rows).contiguous()


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
        xf = logits.to(accumulate_dtype(logits.dtype))
        shifted, lse = shifted_and_lse(xf)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        picked = shifted.gather(1, safe[:, None])[:, 0]
        loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
        count = valid.sum()
        ctx.save_for_backward(shifted, lse, safe, valid, count)
        ctx.reduction = reduction
        ctx.dtype = logits.dtype
        return reduce_losses(loss, count, reduction, logits.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shifted, lse, safe, valid, count = ctx.saved_tensors
        acc = shifted.dtype
        scale = row_scale(grad, ctx.reduction, count, shifted.shape[0], acc)
        d = torch.exp(shifted - lse[:, None])
        d.scatter_(1, safe[:, None], d.gather(1, safe[:, None]) - 1.0)
        # where, not a multiply by zero: an ignored row holding NaN must still get a zero gradient.
        d = torch.where(valid[:, None], d * scale[:, None], torch.zeros_like(d))
        return d.to(ctx.dtype), None, None, None


@register("portable", "cross_entropy")
def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    return _CrossEntropy.apply(logits.contiguous(), targets, ignore_index, reduction)
