"""Native gelu_mul: the portable op, with its exp on lockstep's own kernels (cpu.KERNELS, passed
as the portable op's `kernels`); the rest is elementwise arithmetic, the same bits on every CPU."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import gelu_mul as portable
from . import cpu


@register("native", "gelu_mul")
def gelu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return portable.gelu_mul(gate, up, kernels=cpu.KERNELS)
