"""Native rope: the portable op itself. It has no GEMM, and its sums (if any) are elementwise
adds in fixed orders, the same bits on every CPU and thread count (docs/adr/0010)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import rope as portable


@register("native", "rope")
def rope(x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> Tensor:
    return portable.rope(x, positions, theta, style, scaling)
