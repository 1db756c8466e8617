"""Native rms_norm: the portable op, with any GEMM, exp and log on lockstep's own kernels (cpu.py);
its sums are elementwise adds in fixed orders, the same bits on every CPU."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import rms_norm as portable
from .cpu import native_kernels


@register("native", "rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    with native_kernels():
        return portable.rms_norm(x, weight, eps, offset)
