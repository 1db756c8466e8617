"""Native vocab_logprobs: the portable op's fixed tiles and orders, with every GEMM on lockstep's own
kernels (gemm.py)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import vocab_logprobs as portable
from .gemm import native_gemm


@register("native", "vocab_logprobs")
def vocab_logprobs(hidden: Tensor, weight: Tensor, temperature: float, softcap: float | None = None) -> Tensor:
    with native_gemm():
        return portable.vocab_logprobs(hidden, weight, temperature, softcap)
