"""Triton log_softmax, cross_entropy and the vocabulary-chunk log-sum-exp of selected_logprobs.

A row's log-sum-exp runs over its columns in fixed BLOCK steps from column 0: per lane, a running
max and a rescaled running sum; then the lanes are combined by tl.max / tl.sum over one block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import register
from ._common import ROW_BLOCK, acc_dtype, cast_out
from ..portable.cross_entropy import reduce_losses, row_scale


@triton.jit
def _row_lse(x_ptr, V, scale, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + v0 + lanes, mask=v0 + lanes < V, other=float("-inf")).to(tl.float32) * scale
        new = tl.maximum(m, x)
        shift = tl.where(new == float("-inf"), 0.0, new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = new
    mx = tl.max(m, axis=0)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    return mx + tl.log(tl.sum(s * tl.exp(m - shift), axis=0))


@triton.jit(do_not_specialize=["V"])
def log_softmax_fwd_kernel(x_ptr, y_ptr, lse_ptr, V, BLOCK: tl.constexpr):
    """Program r: row r's log-sum-exp, then y = x - lse."""
    row = tl.program_id(0)
    lse = _row_lse(x_ptr + row * V, V, 1.0, BLOCK)
    tl.store(lse_ptr + row, lse)
    lanes = tl.arange(0, BLOCK)
    for v0 in range(0, V, BLOCK):
        m = v0 + lanes < V
        x = tl.load(x_ptr + row * V + v0 + lanes, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * V + v0 + lanes, cast_out((x - lse), y_ptr), mask=m)


@triton.jit(do_not_specialize=["V"])
def log_softmax_bwd_kernel(x_ptr, lse_ptr, g_ptr, dx_ptr, V, BLOCK: tl.constexpr):
    """Program r: dx = g - softmax * sum(g), sum(g) in BLOCK-lane steps."""
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        acc += tl.load(g_ptr + row * V + v0 + lanes, mask=v0 + lanes < V, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    lse = tl.load(lse_ptr + row)
    for v0 in range(0, V, BLOCK):
        m = v0 + lanes < V
        x = tl.load(x_ptr + row * V + v0 + lanes, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * V + v0 + lanes, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * V + v0 + lanes, cast_out((g - tl.exp(x - lse) * total), dx_ptr), mask=m)


def _block(v: int) -> int:
    return min(ROW_BLOCK, triton.next_power_of_2(v))


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        m, v = x.shape
        y = torch.empty_like(x)
        lse = torch.empty(m, dtype=acc_dtype(x.dtype), device=x.device)
        if m:
            log_softmax_fwd_kernel[(m,)](x, y, lse, v, BLOCK=_block(v))
        ctx.save_for_backward(x, lse)
        return y

    @staticmethod
    def backward(ctx, g):
        x, lse = ctx.saved_tensors
        dx = torch.empty_like(x)
        if x.shape[0]:
            log_softmax_bwd_kernel[(x.shape[0],)](x, lse, g.contiguous(), dx, x.shape[1], BLOCK=_block(x.shape[1]))
        return dx


@register("triton", "log_softmax")
def log_softmax(x):
    return _LogSoftmax.apply(x.contiguous())


@triton.jit(do_not_specialize=["V", "ignore_index"])
def cross_entropy_fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, V, ignore_index, BLOCK: tl.constexpr):
    """Program r: loss of row r (0 when its target is ignored) and its log-sum-exp."""
    row = tl.program_id(0)
    lse = _row_lse(x_ptr + row * V, V, 1.0, BLOCK)
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
        acc = acc_dtype(logits.dtype)
        loss = torch.empty(m, dtype=acc, device=logits.device)
        lse = torch.empty(m, dtype=acc, device=logits.device)
        if m:
            cross_entropy_fwd_kernel[(m,)](logits, targets, loss, lse, v, ignore_index, BLOCK=_block(v))
        valid = targets != ignore_index
        count = valid.sum()
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        # Summed by the portable fixed-order column_sum: the loss vector is tiny.
        return reduce_losses(loss, count, reduction, logits.dtype)

    @staticmethod
    def backward(ctx, g):
        logits, targets, lse, count = ctx.saved_tensors
        m, v = logits.shape
        acc = lse.dtype
        scale = row_scale(g, ctx.reduction, count, m, acc)
        dx = torch.empty_like(logits)
        if m:
            cross_entropy_bwd_kernel[(m,)](logits, targets, lse, scale, dx, v, ctx.ignore_index, BLOCK=_block(v))
        return dx, None, None, None


@register("triton", "cross_entropy")
def cross_entropy(logits, targets, ignore_index, reduction):
    return _CrossEntropy.apply(logits.contiguous(), targets.contiguous(), ignore_index, reduction)


@triton.jit(do_not_specialize=["V", "start", "scale"])
def lse_update_kernel(logits_ptr, t_ptr, max_ptr, sum_ptr, tgt_ptr, V, start, scale, FIRST: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program r: fold one vocabulary chunk of row r's logits into its running max and sum, and pick
    the target's logit if the target falls in the chunk."""
    row = tl.program_id(0)
    lse = _row_lse(logits_ptr + row * V, V, scale, BLOCK)        # the chunk's own log-sum-exp
    t = tl.load(t_ptr + row) - start
    inside = (t >= 0) & (t < V)
    picked = tl.load(logits_ptr + row * V + tl.where(inside, t, 0)).to(tl.float32) * scale
    if FIRST:
        tl.store(max_ptr + row, lse)
        tl.store(sum_ptr + row, 1.0)
        tl.store(tgt_ptr + row, tl.where(inside, picked, 0.0))
    else:
        m = tl.load(max_ptr + row)
        s = tl.load(sum_ptr + row)
        new = tl.maximum(m, lse)
        tl.store(sum_ptr + row, s * tl.exp(m - new) + tl.exp(lse - new))
        tl.store(max_ptr + row, new)
        old = tl.load(tgt_ptr + row)
        tl.store(tgt_ptr + row, tl.where(inside, picked, old))
