"""embedding: rows of a table, with a fixed-order weight gradient."""

from __future__ import annotations

from torch import Tensor

from .. import checks as c
from ..registry import resolve


def embedding(ids: Tensor, weight: Tensor, ids_checked: bool = False) -> Tensor:
    """weight[ids]. ids: [...] int64/int32 in [0, V); weight: [V, D] float. ids_checked: the caller
    made sure, on the host, that every id is in [0, V) (as paged_cache.build_step does for a step's
    tokens), so the ids are not read back from the device to check them.

    Returns [..., D] in weight's dtype. The weight gradient sums each id's occurrences in the order
    of their position in `ids` (no scatter-add atomics).
    """
    c.int_tensor("ids", ids)
    c.float_tensor("weight", weight)
    c.ndim("weight", weight, 2, "a 2-D table [num_embeddings, dim]")
    c.same_device("ids", ids, "weight", weight)
    if not ids_checked:
        c.in_range("ids", ids, weight.shape[0])
    y = resolve("embedding", weight.device)(ids.reshape(-1).long(), weight)
    return y.reshape(*ids.shape, weight.shape[1])
