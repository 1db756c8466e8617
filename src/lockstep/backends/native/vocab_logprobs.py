"""Native vocab_logprobs: the portable op's fixed tiles and orders, with its GEMMs, exp and log on
lockstep's own kernels (cpu.KERNELS, passed as the portable op's `kernels`)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import vocab_logprobs as portable
from . import cpu


@register("native", "vocab_logprobs")
def vocab_logprobs(hidden: Tensor, weight: Tensor, temperature: float, softcap: float | None = None) -> Tensor:
    return portable.vocab_logprobs(hidden, weight, temperature, softcap, kernels=cpu.KERNELS)
