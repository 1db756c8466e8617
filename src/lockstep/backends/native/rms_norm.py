"""Native rms_norm: the portable op itself. It has no GEMM, and its sums (if any) are elementwise
adds in fixed orders, the same bits on every CPU and thread count (docs/adr/0010)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import rms_norm as portable


@register("native", "rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    return portable.rms_norm(x, weight, eps, offset)
