"""Portable vocab_logprobs: every entry's log-probability, from the chunks and the log-sum-exp that
selected_logprobs computes, so each entry has the bits selected_logprobs gives that target."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics.cpu_kernels import CpuKernels
from ...numerics.fixed_order import scaled_logits
from ...registry import register
from . import selected_logprobs


@register("portable", "vocab_logprobs")
def vocab_logprobs(hidden: Tensor, weight: Tensor, temperature: float, softcap: float | None = None, *,
                   kernels: CpuKernels | None = None) -> Tensor:
    """The portable vocab_logprobs, its GEMMs, exp, log and sums on the CPU kernels `kernels` (None:
    PyTorch's)."""
    hidden = hidden.contiguous()
    chunks: list[Tensor] = []
    with torch.no_grad():
        logits = selected_logprobs.whole_logits(hidden, weight, softcap, kernels=kernels)
        if logits is not None:      # elementwise over the whole, so each entry has the chunk's bits
            lse = selected_logprobs.online_lse(hidden, weight, temperature, cap=softcap, logits=logits,
                                               kernels=kernels)
            return scaled_logits(logits, temperature) - lse[:, None]
        lse = selected_logprobs.online_lse(
            hidden, weight, temperature, lambda start, logits: chunks.append(scaled_logits(logits, temperature)),
            softcap, kernels=kernels)
        return torch.cat(chunks, dim=1) - lse[:, None]
