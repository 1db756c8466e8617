"""vocab_logprobs: the log-probability of every vocabulary entry, with selected_logprobs' bits."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import autocast
from ..numerics import softcap as capping
from .. import checks as c
from ..registry import resolve


def vocab_logprobs(hidden: Tensor, weight: Tensor, temperature: float = 1.0, softcap: float | None = None) -> Tensor:
    """log softmax(cap(hidden @ weight.T) / temperature) over the whole vocabulary, for sampling.

    hidden: [..., D] float; weight: [V, D] of hidden's dtype (the LM head). Returns [..., V] float32
    (float64 for float64 inputs). Entry [r, t] has exactly the bits of
    `selected_logprobs(hidden[r], weight, t, temperature, softcap)`, the logprob a trainer recomputes, so an
    engine samples from and reports one distribution in one pass over the vocabulary. Inference
    only: no gradient.
    """
    hidden, weight = autocast.cast("selected_logprobs", hidden, weight)
    c.lm_head(hidden, weight)
    c.temperature(temperature)
    softcap = capping.check(softcap)
    rows = hidden.reshape(-1, hidden.shape[-1])
    with autocast.off(hidden.device.type), torch.no_grad():
        out = resolve("vocab_logprobs", hidden.device)(rows, weight, float(temperature), softcap)
    return out.reshape(*hidden.shape[:-1], weight.shape[0])
