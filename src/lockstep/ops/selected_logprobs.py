"""selected_logprobs: the LM head fused with log p(target), chunked over the vocabulary."""

from __future__ import annotations

from torch import Tensor

from .. import autocast
from ..numerics import softcap as capping
from .. import checks as c
from ..registry import resolve


def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                      softcap: float | None = None) -> Tensor:
    """log softmax(cap(hidden @ weight.T) / temperature)[target] without materialising the full logits.

    hidden: [..., D] float; weight: [V, D] of hidden's dtype (the LM head); targets: [...] int in [0, V).
    Returns [...] float32 (float64 for float64 inputs). The vocabulary is processed in fixed-size chunks with an online
    log-sum-exp, forward and backward, so no GEMM makes more than O(tokens x chunk), except that the native
    kernels take a few rows' logits (up to 2^23 of them) in one GEMM with the chunks' bits; on a CPU a forward
    whose backward will run keeps its chunks for it within LOCKSTEP_KEEP_LOGITS_BYTES (1 GiB per call;
    docs/adr/0028), with the bits of computing them again.
    temperature > 0 divides the fp32 logits (the distribution a sampler at that temperature uses).
    softcap: cap(x) = softcap * tanh(x / softcap) on the fp32 logits first (Gemma's final-logit
    softcapping); None leaves them as they are.
    """
    hidden, weight = autocast.cast("selected_logprobs", hidden, weight)
    c.lm_head(hidden, weight)
    c.int_tensor("targets", targets)
    c.same_device("targets", targets, "hidden", hidden)
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets: expected shape {tuple(hidden.shape[:-1])} (hidden without its last dimension), got {tuple(targets.shape)}")
    c.in_range("targets", targets, weight.shape[0])
    c.temperature(temperature)
    softcap = capping.check(softcap)
    with autocast.off(hidden.device.type):
        out = resolve("selected_logprobs", hidden.device)(
            hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(), float(temperature),
            softcap)
    return out.reshape(targets.shape)
