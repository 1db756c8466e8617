"""Portable embedding: a gather forward; the weight gradient adds each id's occurrences in order."""

from __future__ import annotations

import torch
from torch import Tensor

from ...fixed_order import accumulate_dtype
from ...registry import register


def embedding_weight_grad(ids: Tensor, grad: Tensor, num_embeddings: int) -> Tensor:
    """dW[v] = sum of grad[t] over the positions t with ids[t] == v, added in increasing t.

    ids: [T] int64; grad: [T, D]. Returns [V, D] in the accumulation dtype. Step r adds the r-th
    occurrence of every id at once; within a step the ids are distinct, so the indexed add has no
    conflicting writes and no order to vary. Zero-gradient (padding) rows add exact zeros.
    """
    acc = accumulate_dtype(grad.dtype)
    out = grad.new_zeros((num_embeddings, grad.shape[1]), dtype=acc)
    if ids.numel() == 0:
        return out
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    _, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(ids.numel(), device=ids.device) - torch.repeat_interleave(starts, counts)
    by_rank = torch.argsort(rank, stable=True)
    per_rank = torch.bincount(rank).tolist()
    g = grad.to(acc)
    begin = 0
    for n in per_rank:
        pos = order[by_rank[begin:begin + n]]
        rows = ids[pos]
        out[rows] = out[rows] + g[pos]
        begin += n
    return out


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.num_embeddings = weight.shape[0]
        return weight[ids]

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (ids,) = ctx.saved_tensors
        dw = embedding_weight_grad(ids, grad_y.contiguous(), ctx.num_embeddings)
        return None, dw.to(grad_y.dtype)


@register("portable", "embedding")
def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return _Embedding.apply(ids, weight)
