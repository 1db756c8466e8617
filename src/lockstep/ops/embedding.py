"""embedding: rows of a table, with a fixed-order weight gradient."""

from __future__ import annotations

from torch import Tensor

from .. import checks as c
from ..registry import resolve


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """weight[ids]. ids: [...] int64/int32 in [0, V); weight: [V, D] float.

    Returns [..., D] in weight's dtype. The weight gradient sums each id's occurrences in the order
    of their position in `ids` (no scatter-add atomics).
    """
    c.int_tensor("ids", ids)
    c.float_tensor("weight", weight)
    c.ndim("weight", weight, 2, "a 2-D table [num_embeddings, dim]")
    c.same_device("ids", ids, "weight", weight)
    c.in_range("ids", ids, weight.shape[0])
    y = resolve("embedding", weight.device)(ids.reshape(-1).long(), weight)
    return y.reshape(*ids.shape, weight.shape[1])
