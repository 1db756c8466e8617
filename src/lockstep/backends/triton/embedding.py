"""Triton embedding: a gather forward; dW adds each id's occurrences in position order, one program
per distinct id, no atomics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import grad_tree
from ...numerics.fixed_order import accumulate_dtype
from ...registry import register
from ...numerics.second_order import first_order_only


@triton.jit(do_not_specialize=["D"])
def embedding_fwd_kernel(ids_ptr, w_ptr, y_ptr, D, BLOCK: tl.constexpr):
    """Program t copies row ids[t] of the table."""
    t = tl.program_id(0)
    row = tl.load(ids_ptr + t)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        tl.store(y_ptr + t * D + cols, tl.load(w_ptr + row * D + cols, mask=cols < D), mask=cols < D)


@triton.jit(do_not_specialize=["D"])
def embedding_bwd_kernel(order_ptr, starts_ptr, counts_ptr, rows_ptr, g_ptr, dw_ptr, D, BLOCK: tl.constexpr):
    """Program u: dW[rows[u]] = the gradient rows of that id's occurrences, added in position order
    from 0 (rows: where each distinct id's sum goes; the caller keeps them compact)."""
    u = tl.program_id(0)
    start = tl.load(starts_ptr + u)
    count = tl.load(counts_ptr + u)
    row = tl.load(rows_ptr + u)
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
        ctx.use = grad_tree.capture("embedding", weight, t, ctx.needs_input_grad[1])
        return y

    @staticmethod
    @first_order_only("embedding")
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        v, d = ctx.shape
        g = g.contiguous()

        def partial(start, stop):
            rows = ids[start:stop]
            order = torch.argsort(rows, stable=True)
            uids, counts = torch.unique_consecutive(rows[order], return_counts=True)
            dw = torch.zeros((uids.numel(), d), dtype=accumulate_dtype(g.dtype), device=g.device)
            if rows.numel():
                starts = torch.cumsum(counts, 0) - counts
                slots = torch.arange(uids.numel(), device=g.device)
                embedding_bwd_kernel[(uids.numel(),)](order, starts, counts, slots, g[start:stop], dw, d,
                                                      BLOCK=min(1024, triton.next_power_of_2(d)))
            return grad_tree.RowSparse(uids, dw, v)

        dw = grad_tree.per_unit(ctx.use, ids.numel(), partial, g.dtype)
        return None, (None if dw is None else dw.to(g.dtype))


@register("triton", "embedding")
def embedding(ids, weight):
    return _Embedding.apply(ids.contiguous(), weight.contiguous())
