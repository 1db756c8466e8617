"""Eager cross_entropy: torch.nn.functional.cross_entropy. Not invariant; for comparison."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ...registry import register


@register("eager", "cross_entropy")
def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
