"""Native cross_entropy: the portable op, with its exp and log on lockstep's own kernels (cpu.KERNELS,
passed as the portable op's `kernels`); its sums are elementwise adds in fixed orders, the same
bits on every CPU."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import cross_entropy as portable
from . import cpu


@register("native", "cross_entropy")
def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    return portable.cross_entropy(logits, targets, ignore_index, reduction, kernels=cpu.KERNELS)
