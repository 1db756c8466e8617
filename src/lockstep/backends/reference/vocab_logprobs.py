"""Float64 reference vocab_logprobs: the textbook formula, written for clarity; shares no code with
the kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from .linear import linear
from .log_softmax import log_softmax


def vocab_logprobs(hidden: Tensor, weight: Tensor, temperature: float = 1.0, softcap: float | None = None) -> Tensor:
    logits = linear(hidden, weight)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return log_softmax(logits / temperature)


register("reference", "vocab_logprobs")(vocab_logprobs)
