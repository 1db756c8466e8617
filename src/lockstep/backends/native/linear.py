"""Native linear: the portable op's fixed tiles and orders, with every GEMM on lockstep's own
kernels (gemm.py)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import linear as portable
from .gemm import native_gemm


@register("native", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int = 1, split_n: int = 1) -> Tensor:
    with native_gemm():
        return portable.linear(x, weight, bias, split_k, split_n)
