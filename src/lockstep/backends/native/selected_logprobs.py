"""Native selected_logprobs: the portable op's fixed tiles and orders, with its GEMMs, exp and log on
lockstep's own kernels (cpu.KERNELS, passed as the portable op's `kernels`)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import selected_logprobs as portable
from . import cpu


@register("native", "selected_logprobs")
def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, softcap: float | None = None) -> Tensor:
    return portable.selected_logprobs(hidden, weight, targets, temperature, softcap, kernels=cpu.KERNELS)
