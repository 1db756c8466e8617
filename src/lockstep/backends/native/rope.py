"""Native rope: the portable op, with any GEMM, exp and log on lockstep's own kernels (cpu.py);
its sums are elementwise adds in fixed orders, the same bits on every CPU."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import rope as portable
from .cpu import native_kernels


@register("native", "rope")
def rope(x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> Tensor:
    with native_kernels():
        return portable.rope(x, positions, theta, style, scaling)
