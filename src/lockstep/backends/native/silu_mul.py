"""Native silu_mul: the portable op itself. It has no GEMM, and its sums (if any) are elementwise
adds in fixed orders, the same bits on every CPU and thread count (docs/adr/0010)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import silu_mul as portable


@register("native", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return portable.silu_mul(gate, up)
