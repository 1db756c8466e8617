"""Native selected_logprobs: the portable op's fixed tiles and orders, with its GEMMs, exp and log on
lockstep's own kernels (cpu.py)."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import selected_logprobs as portable
from .cpu import native_kernels


@register("native", "selected_logprobs")
def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, softcap: float | None = None) -> Tensor:
    with native_kernels():
        return portable.selected_logprobs(hidden, weight, targets, temperature, softcap)
