"""Eager vocab_logprobs: the LM head, then log_softmax over the full logits in fp32. Not invariant;
for comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...registry import register


@register("eager", "vocab_logprobs")
def vocab_logprobs(hidden: Tensor, weight: Tensor, temperature: float, softcap: float | None = None) -> Tensor:
    logits = F.linear(hidden, weight)
    logits = logits.float() if logits.dtype != torch.float64 else logits
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)
