"""Native gelu_mul: the portable op, with any GEMM, exp and log on lockstep's own kernels (cpu.py);
its sums are elementwise adds in fixed orders, the same bits on every CPU."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import gelu_mul as portable
from .cpu import native_kernels


@register("native", "gelu_mul")
def gelu_mul(gate: Tensor, up: Tensor) -> Tensor:
    with native_kernels():
        return portable.gelu_mul(gate, up)
