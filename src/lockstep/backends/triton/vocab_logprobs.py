"""Triton vocab_logprobs: every entry's log-probability, from the chunk logits and the log-sum-exp
that selected_logprobs computes. An entry is (logit * scale) - lse, the same two fp32 roundings
selected_logprobs makes for its target (the kernel's multiply, then a subtraction), so each entry
has the bits selected_logprobs gives that target."""

from __future__ import annotations

import torch

from ...registry import register
from .selected_logprobs import online_lse


@register("triton", "vocab_logprobs")
def vocab_logprobs(hidden, weight, temperature, softcap=None):
    chunks = []
    with torch.no_grad():
        no_target = torch.full((hidden.shape[0],), -1, dtype=torch.int64, device=hidden.device)
        _, lse = online_lse(hidden.contiguous(), weight.contiguous(), no_target, temperature,
                            lambda start, logits: chunks.append(logits), cap=softcap)
        scaled = torch.cat(chunks, dim=1) * (1.0 / temperature)
        return scaled - lse[:, None]
