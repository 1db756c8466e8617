"""Native log_softmax: the portable op itself. It has no GEMM, and its sums (if any) are elementwise
adds in fixed orders, the same bits on every CPU and thread count (docs/adr/0010)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import log_softmax as portable


@register("native", "log_softmax")
def log_softmax(x: Tensor) -> Tensor:
    return portable.log_softmax(x)
