"""Native linear: the portable op's fixed tiles and orders, with its GEMMs on lockstep's own
kernels (cpu.KERNELS, passed as the portable op's `kernels`)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import linear as portable
from . import cpu


@register("native", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int = 1, split_n: int = 1) -> Tensor:
    return portable.linear(x, weight, bias, split_k, split_n, kernels=cpu.KERNELS)
