"""Native cross_entropy: the portable op itself. It has no GEMM, and its sums (if any) are elementwise
adds in fixed orders, the same bits on every CPU and thread count (docs/adr/0010)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import cross_entropy as portable


@register("native", "cross_entropy")
def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    return portable.cross_entropy(logits, targets, ignore_index, reduction)
