"""Eager selected_logprobs: The LM head and log_softmax over the full logits, then the targets'
entries. Not invariant; for comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...registry import register


@register("eager", "selected_logprobs")
def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, softcap: float | None = None) -> Tensor:
    logits = F.linear(hidden, weight)
    logits = logits.float() if logits.dtype != torch.float64 else logits
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    return lp if lp.dtype == torch.float64 else lp.float()
