"""The "reference" backend: lockstep.reference's float64 functions behind the op registry.

It lets a whole model run on the independent float64 implementations (the chain reference of
CONTRACT.md section 4). Outputs are float64; run the model in float64 under this backend.
"""

from __future__ import annotations

import torch

from . import reference
from .backend import register


@register("reference", "linear")
def linear(x, weight, bias):
    return reference.linear(x, weight, bias)


@register("reference", "rms_norm")
def rms_norm(x, weight, eps, offset):
    return reference.rms_norm(x, weight, eps, offset)


@register("reference", "rope")
def rope(x, positions, theta, style, scaling):
    return reference.rope(x, positions, theta, style, scaling)


@register("reference", "silu_mul")
def silu_mul(gate, up):
    return reference.silu_mul(gate, up)


@register("reference", "embedding")
def embedding(ids, weight):
    return reference.embedding(ids, weight)


@register("reference", "log_softmax")
def log_softmax(x):
    return reference.log_softmax(x)


@register("reference", "selected_logprobs")
def selected_logprobs(hidden, weight, targets, temperature):
    return reference.selected_logprobs(hidden, weight, targets, temperature)


@register("reference", "cross_entropy")
def cross_entropy(logits, targets, ignore_index, reduction):
    return reference.cross_entropy(logits, targets, ignore_index, reduction)


@register("reference", "attention")
def attention(q, k, v, cu_q, cu_k, scale, causal, window):
    return reference.attention(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), scale, causal, window)
