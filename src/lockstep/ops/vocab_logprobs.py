"""vocab_logprobs: the log-probability of every vocabulary entry, with selected_logprobs' bits."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import resolve


def vocab_logprobs(hidden: Tensor, weight: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(hidden @ weight.T / temperature) over the whole vocabulary, for sampling.

    hidden: [..., D] float; weight: [V, D] of hidden's dtype (the LM head). Returns [..., V] float32
    (float64 for float64 inputs). Entry [r, t] has exactly the bits of
    `selected_logprobs(hidden[r], weight, t, temperature)`, the logprob a trainer recomputes, so an
    engine samples from and reports one distribution in one pass over the vocabulary. Inference
    only: no gradient.
    """
    hidden, weight = autocast.cast("selected_logprobs", hidden, weight)
    c.float_tensor("hidden", hidden)
    c.at_least_1d("hidden", hidden)
    c.float_tensor("weight", weight)
    c.ndim("weight", weight, 2, "a 2-D LM head [vocab, hidden]")
    c.same_dtype("weight", weight, "hidden", hidden)
    c.same_device("weight", weight, "hidden", hidden)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: expected shape [V, {hidden.shape[-1]}] to match hidden's last dimension, "
                         f"got {tuple(weight.shape)}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature: expected a positive finite number, got {temperature!r}")
    rows = hidden.reshape(-1, hidden.shape[-1])
    with autocast.off(hidden.device.type), torch.no_grad():
        out = resolve("vocab_logprobs", hidden.device)(rows, weight, float(temperature))
    return out.reshape(*hidden.shape[:-1], weight.shape[0])
