"""Native linear: the portable op's fixed tiles and orders, with its GEMMs, exp and log on
lockstep's own kernels (cpu.py)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import linear as portable
from .cpu import native_kernels


@register("native", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int = 1, split_n: int = 1) -> Tensor:
    with native_kernels():
        return portable.linear(x, weight, bias, split_k, split_n)
