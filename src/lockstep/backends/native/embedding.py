"""Native embedding: the portable op itself. It has no GEMM, and its sums (if any) are elementwise
adds in fixed orders, the same bits on every CPU and thread count (docs/adr/0010)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import embedding as portable


@register("native", "embedding")
def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return portable.embedding(ids, weight)
