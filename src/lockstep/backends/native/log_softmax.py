"""Native log_softmax: the portable op, with its exp and log on lockstep's own kernels (cpu.KERNELS,
passed as the portable op's `kernels`); its sums are elementwise adds in fixed orders, the same
bits on every CPU."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import log_softmax as portable
from . import cpu


@register("native", "log_softmax")
def log_softmax(x: Tensor) -> Tensor:
    return portable.log_softmax(x, kernels=cpu.KERNELS)
