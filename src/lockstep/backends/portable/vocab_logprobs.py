"""Portable vocab_logprobs: every entry's log-probability, from the chunks and the log-sum-exp that
selected_logprobs computes, so each entry has the bits selected_logprobs gives that target."""

from __future__ import annotations

import torch
from torch import Tensor

from ...fixed_order import scaled_logits
from ...registry import register
from .selected_logprobs import online_lse


@register("portable", "vocab_logprobs")
def vocab_logprobs(hidden: Tensor, weight: Tensor, temperature: float, softcap: float | None = None) -> Tensor:
    chunks: list[Tensor] = []
    with torch.no_grad():
        lse = online_lse(hidden.contiguous(), weight, temperature,
                         lambda start, logits: chunks.append(scaled_logits(logits, temperature)), softcap)
        return torch.cat(chunks, dim=1) - lse[:, None]
