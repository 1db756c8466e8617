"""Native gelu_mul: the portable op itself. It has no GEMM, and its sums (if any) are elementwise
adds in fixed orders, the same bits on every CPU and thread count (docs/adr/0010)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import gelu_mul as portable


@register("native", "gelu_mul")
def gelu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return portable.gelu_mul(gate, up)
