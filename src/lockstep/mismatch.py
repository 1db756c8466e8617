"""The sampler-vs-trainer mismatch of contract section 4, defined once for verify, the batch
experiment, `lockstep rl` and the TRL integration.

For the tokens a sampler drew, d = trainer logprob - sampler logprob (float64):

    max_abs_dlogp  max |d|
    approx_kl0     mean(e^d - 1 - d): the usual estimate of KL(sampler || trainer)
    clipfrac0      the share of tokens whose ratio e^d lies outside the clip range
    mean_ratio     mean e^d, the importance ratio an RL framework would correct with

The 0 says "before any update": what PPO's first epoch sees. lockstep promises 0, 0, 0 and a mean
ratio of exactly 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import contract

FIELDS = ("tokens", "max_abs_dlogp", "approx_kl0", "clipfrac0", "mean_ratio")


def mismatch(trainer_logprobs: Tensor, sampler_logprobs: Tensor, clip_range: tuple[float, float] | None = None) -> dict:
    """The metrics of FIELDS for matching logprobs (any float dtype, any shape, same numel).
    clip_range defaults to the contract's ([chain] clip_range). No tokens: every metric 0, ratio 1."""
    if trainer_logprobs.numel() != sampler_logprobs.numel():
        raise ValueError(f"sampler_logprobs: expected {trainer_logprobs.numel()} logprobs (one per trained token), "
                         f"got {sampler_logprobs.numel()}")
    if trainer_logprobs.numel() == 0:
        return {"tokens": 0, "max_abs_dlogp": 0.0, "approx_kl0": 0.0, "clipfrac0": 0.0, "mean_ratio": 1.0}
    lo, hi = clip_range if clip_range is not None else contract.load()["chain"]["clip_range"]
    d = trainer_logprobs.detach().reshape(-1).cpu().double() - sampler_logprobs.detach().reshape(-1).cpu().double()
    ratio = torch.exp(d)
    return {"tokens": int(d.numel()), "max_abs_dlogp": float(d.abs().max()),
            "approx_kl0": float((ratio - 1 - d).mean()),
            "clipfrac0": float(((ratio < lo) | (ratio > hi)).double().mean()), "mean_ratio": float(ratio.mean())}
