"""Native selected_logprobs: the portable op's fixed tiles and orders, with every GEMM on lockstep's own
kernels (gemm.py)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import selected_logprobs as portable
from .gemm import native_gemm


@register("native", "selected_logprobs")
def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, softcap: float | None = None) -> Tensor:
    with native_gemm():
        return portable.selected_logprobs(hidden, weight, targets, temperature, softcap)
