"""Portable embedding: a gather forward; the weight gradient adds each id's occurrences in order."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics import grad_tree
from ...numerics.fixed_order import accumulate_dtype
from ...registry import register


def embedding_weight_grad(ids: Tensor, grad: Tensor, num_embeddings: int) -> grad_tree.RowSparse:
    """dW[v] = sum of grad[t] over the positions t with ids[t] == v, added in increasing t, from
    +0.0; the rows of ids that occur, as a RowSparse of num_embeddings rows (the others are +0.0).

    ids: [T] int64; grad: [T, D]; values in the accumulation dtype. Step r adds the r-th occurrence
    of every id at once; within a step the ids are distinct, so the indexed add has no conflicting
    writes and no order to vary. Zero-gradient (padding) rows add exact zeros.
    """
    acc = accumulate_dtype(grad.dtype)
    order = torch.argsort(ids, stable=True)
    rows, counts = torch.unique_consecutive(ids[order], return_counts=True)
    out = grad.new_zeros((rows.numel(), grad.shape[1]), dtype=acc)
    if ids.numel() == 0:
        return grad_tree.RowSparse(rows, out, num_embeddings)
    slot = torch.repeat_interleave(torch.arange(rows.numel(), device=ids.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(ids.numel(), device=ids.device) - torch.repeat_interleave(starts, counts)
    by_rank = torch.argsort(rank, stable=True)
    per_rank = torch.bincount(rank).tolist()
    g = grad.to(acc)
    begin = 0
    for n in per_rank:
        sel = by_rank[begin:begin + n]
        out[slot[sel]] = out[slot[sel]] + g[order[sel]]
        begin += n
    return grad_tree.RowSparse(rows, out, num_embeddings)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.num_embeddings = weight.shape[0]
        ctx.use = grad_tree.capture("embedding", weight, ids.shape[0], ctx.needs_input_grad[1])
        return weight[ids]

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (ids,) = ctx.saved_tensors
        g = grad_y.contiguous()
        dw = grad_tree.per_unit(ctx.use, ids.shape[0],
                                lambda s, e: embedding_weight_grad(ids[s:e], g[s:e], ctx.num_embeddings), g.dtype)
        return None, (None if dw is None else dw.to(grad_y.dtype))


@register("portable", "embedding")
def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return _Embedding.apply(ids, weight)
