"""Sampling whose result depends only on the request: its logits, its parameters, its seed and the
token's position, never on what else shares the batch.

Sampling is Gumbel-max: token = argmax(logits / T + g) with g = -log(-log(u)). u comes from a
counter-based hash of (seed, position, token id), computed with integer torch ops that give the
same bits on any device and in any batch. top-k and top-p remove tokens before the argmax. The
reported logprob is that of the temperature-scaled distribution *before* truncation, because that
is what a trainer recomputes from the model (`lockstep.logprobs(..., temperature=T)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import ops

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    """temperature 0 is greedy. top_k 0 and top_p 1.0 disable truncation. The seed keys the noise."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0

    def validate(self, vocab_size: int) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens!r}")
        bad = [s for s in self.stop_token_ids if not isinstance(s, int) or not 0 <= s < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: expected ids in [0, {vocab_size}), got {bad}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an int, got {self.seed!r}")


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without overflowing int64: multiply in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """u in (0, 1), float64 [vocab_size], a pure function of (seed, position, token id)."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    key = _mix32(torch.tensor([(seed * 0x9E3779B1) & _MASK32], dtype=torch.int64, device=device) ^ (position & _MASK32))
    a = _mix32(ids ^ key)
    b = _mix32(a ^ _mix32(key ^ 0x5BD1E995))
    bits = a * 2 ** 21 + (b >> 11)       # 53 random bits
    return (bits.to(torch.float64) + 0.5) / 2.0 ** 53


def sample_tokens(hidden: Tensor, lm_head: Tensor, params: list[SamplingParams], positions: list[int]) -> tuple[Tensor, Tensor]:
    """Next token and its logprob for each row of hidden [n, H].

    Each row is computed from its own row of logits and its own (seed, position), so the result is
    the same whatever other rows are present. Returns (tokens [n] int64, logprobs [n] float32)."""
    logits = ops.linear(hidden, lm_head).to(torch.float32)
    tokens = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device)
    for i, (p, pos) in enumerate(zip(params, positions)):
        row = logits[i]
        if p.temperature == 0:
            tokens[i] = torch.argmax(row)
            continue
        scaled = row / p.temperature
        allowed = torch.ones_like(scaled, dtype=torch.bool)
        if p.top_k:
            kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
            allowed &= scaled >= kth
        if p.top_p < 1.0:
            probs = torch.exp(ops.log_softmax(torch.where(allowed, scaled, float("-inf"))))
            order = torch.argsort(probs, descending=True, stable=True)
            before = torch.cumsum(probs[order], 0) - probs[order]
            keep = torch.zeros_like(allowed)
            keep[order] = before < p.top_p
            allowed &= keep
        gumbel = -torch.log(-torch.log(uniform_noise(p.seed, pos, row.numel(), row.device)))
        score = torch.where(allowed, scaled.to(torch.float64) + gumbel, torch.tensor(float("-inf"), dtype=torch.float64))
        tokens[i] = torch.argmax(score)
    logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    for t in sorted(set(temps)):
        rows = torch.tensor([i for i, x in enumerate(temps) if x == t], device=hidden.device)
        logprobs[rows] = ops.selected_logprobs(hidden[rows], lm_head, tokens[rows], temperature=t)
    return tokens, logprobs
