"""Float64 reference selected_logprobs: the textbook formula, written for clarity; shares no code
with the kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from .linear import linear
from .log_softmax import log_softmax


def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                      softcap: float | None = None) -> Tensor:
    logits = linear(hidden, weight)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logp = log_softmax(logits / temperature)
    return logp.gather(-1, targets.long()[..., None])[..., 0]


register("reference", "selected_logprobs")(selected_logprobs)
