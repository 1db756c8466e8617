"""Eager embedding: torch.nn.functional.embedding; its backward adds with index_put, in no promised
order. Not invariant; for comparison."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ...registry import register


@register("eager", "embedding")
def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return F.embedding(ids, weight)
