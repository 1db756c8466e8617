"""Native silu_mul: the portable op, with any GEMM, exp and log on lockstep's own kernels (cpu.py);
its sums are elementwise adds in fixed orders, the same bits on every CPU."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import silu_mul as portable
from .cpu import native_kernels


@register("native", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    with native_kernels():
        return portable.silu_mul(gate, up)
