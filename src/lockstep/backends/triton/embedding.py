"""Triton embedding: a gather forward; dW adds each id's occurrences in position order, one program
per distinct id, no atomics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...fixed_order import accumulate_dtype
from ...registry import register


@triton.jit(do_not_specialize=["D"])
def embedding_fwd_kernel(ids_ptr, w_ptr, y_ptr, D, BLOCK: tl.constexpr):
    """Program t copies row ids[t] of the table."""
    t = tl.program_id(0)
    row = tl.load(ids_ptr + t)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        tl.store(y_ptr + t * D + cols, tl.load(w_ptr + row * D + cols, mask=cols < D), mask=cols < D)


@triton.jit(do_not_specialize=["D"])
def embedding_bwd_kernel(order_ptr, starts_ptr, counts_ptr, uids_ptr, g_ptr, dw_ptr, D, BLOCK: tl.constexpr):
    """Program u: dW[uids[u]] = the gradient rows of that id's occurrences, added in position order."""
    u = tl.program_id(0)
    start = tl.load(starts_ptr + u)
    count = tl.load(counts_ptr + u)
    row = tl.load(uids_ptr + u)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(0, count):
            t = tl.load(order_ptr + start + j)
            acc += tl.load(g_ptr + t * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(dw_ptr + row * D + cols, acc, mask=cols < D)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        t, d = ids.numel(), weight.shape[1]
        y = torch.empty((t, d), dtype=weight.dtype, device=weight.device)
        if t:
            embedding_fwd_kernel[(t,)](ids, weight, y, d, BLOCK=min(1024, triton.next_power_of_2(d)))
        ctx.save_for_backward(ids)
        ctx.shape = weight.shape
        return y

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        v, d = ctx.shape
        dw = torch.zeros((v, d), dtype=accumulate_dtype(g.dtype), device=g.device)
        if ids.numel():
            order = torch.argsort(ids, stable=True)
            uids, counts = torch.unique_consecutive(ids[order], return_counts=True)
            starts = torch.cumsum(counts, 0) - counts
            embedding_bwd_kernel[(uids.numel(),)](order, starts, counts, uids, g.contiguous(), dw, d,
                                                  BLOCK=min(1024, triton.next_power_of_2(d)))
        return None, dw.to(g.dtype)


@register("triton", "embedding")
def embedding(ids, weight):
    return _Embedding.apply(ids.contiguous(), weight.contiguous())
