"""Sampling whose result depends only on the request: its logits, its parameters, its seed and the
token's position, never on what else shares the batch.

One pass over the vocabulary per token: `ops.vocab_logprobs` gives the log-probabilities of the
temperature-scaled distribution, whose entries have the bits a trainer recomputes with
`lockstep.logprobs(..., temperature=T)` (`selected_logprobs`). The sampler draws from them and
reports the drawn entry, so what it reports is what the trainer sees.

Drawing is Gumbel-max: token = argmax(logp + g) over the allowed tokens, with g = -log(-log(u))
and u from a counter-based hash of (seed, completion index, position, token id), computed with
integer torch ops that give the same bits on any device and in any batch; the logarithms are
lockstep's own (`exact_math.log_float64`), and top-p's probabilities use the CPU backend's exp, so
a draw does not follow the CPU's vector unit either. Which tokens are allowed, and how likely, is shaped in this order: the repetition penalty, then top-k, min-p and top-p. The
reported logprob (and the top-N alternatives) are those of the temperature-scaled distribution
*before* that shaping, because that is what a trainer recomputes from the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .numerics import exact_math
from . import ops
from .numerics.exact_math import log_float64
from .numerics.fixed_order import exp
from .registry import cpu_backend_kernel_set

_MASK32 = 0xFFFFFFFF
MIN_TEMPERATURE = 1e-6


@dataclass
class SamplingParams:
    """How one request is sampled.

    temperature 0 is greedy. top_k 0, top_p 1.0 and min_p 0.0 disable truncation. n completions are
    drawn for the prompt, completion i with the noise stream (seed, i). repetition_penalty r > 1
    divides the probability of every token already in the prompt or the completion by r before
    the draw. stop_token_ids and stop (strings; they need a tokenizer) end a completion. logprobs N
    reports the N most likely tokens at each step as well."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 16
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    logprobs: int = 0
    seed: int = 0

    # The most completions per request, and the most alternatives reported per token.
    MAX_N = 128
    MAX_LOGPROBS = 20

    def validate(self, vocab_size: int) -> None:
        t = self.temperature
        # Below MIN_TEMPERATURE the scaled logits overflow fp32; 0 is greedy.
        if (not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0
                or 0 < t < MIN_TEMPERATURE):
            raise ValueError(f"temperature: expected 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {t!r}")
        if not _int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1], got {self.min_p!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty: expected a positive finite number (1 disables it), got {r!r}")
        if not _int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens!r}")
        if not _int(self.n) or not 1 <= self.n <= self.MAX_N:
            raise ValueError(f"n: expected an int in [1, {self.MAX_N}], got {self.n!r}")
        bad = [s for s in self.stop_token_ids if not _int(s) or not 0 <= s < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: expected ids in [0, {vocab_size}), got {bad}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: expected a list of non-empty strings, got {self.stop!r}")
        if not _int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs: expected an int in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if not _int(self.seed):
            raise ValueError(f"seed: expected an int, got {self.seed!r}")

    @property
    def report_temperature(self) -> float:
        """The temperature of the distribution whose logprobs are reported (greedy: 1)."""
        return self.temperature if self.temperature > 0 else 1.0


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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


def uniform_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu",
                  stream: int = 0) -> Tensor:
    """u in (0, 1), float64 [vocab_size], a pure function of (seed, stream, position, token id).
    stream 0 is a request's first completion; completion i of n uses stream i."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    key = _mix32(torch.tensor([(seed * 0x9E3779B1) & _MASK32], dtype=torch.int64, device=device) ^ (position & _MASK32))
    if stream:
        key = _mix32(key ^ ((stream * 0x85EBCA77) & _MASK32))
    a = _mix32(ids ^ key)
    b = _mix32(a ^ _mix32(key ^ 0x5BD1E995))
    bits = a * 2 ** 21 + (b >> 11)       # 53 random bits
    return (bits.to(torch.float64) + 0.5) / 2.0 ** 53


@dataclass
class Draw:
    """What the sampler drew for one row: the token, its logprob, and (when asked) the top-N
    (token, logprob) pairs, most likely first, ties broken by the lower token id."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def probabilities(scores: Tensor, allowed: Tensor) -> Tensor:
    """softmax of the allowed scores [V] (float32), for top-p. Its exp runs on the CPU backend's
    kernels: PyTorch's float32 exp can follow the instruction set (MKL's vector math on Intel,
    docs/adr/0010), which could move a token across the top-p line."""
    return exp(ops.log_softmax(torch.where(allowed, scores, float("-inf"))), kernels=cpu_backend_kernel_set())


def allowed_tokens(logp: Tensor, p: SamplingParams, seen: Tensor | None) -> tuple[Tensor, Tensor]:
    """(scores, allowed) for one row of log-probabilities [V] (float32): the repetition penalty
    applied to the scores, then top-k, min-p and top-p restrict the allowed set."""
    scores = logp
    if p.repetition_penalty != 1.0 and seen is not None and bool(seen.any()):
        scores = torch.where(seen, logp - exact_math.log(p.repetition_penalty), logp)
    allowed = torch.isfinite(scores)
    if p.top_k:
        kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
        allowed &= scores >= kth
    if p.min_p > 0:
        allowed &= scores >= torch.amax(scores) + exact_math.log(p.min_p)
    if p.top_p < 1.0:
        probs = probabilities(scores, allowed)
        order = torch.argsort(probs, descending=True, stable=True)
        before = torch.cumsum(probs[order], 0) - probs[order]
        keep = torch.zeros_like(allowed)
        keep[order] = before < p.top_p
        allowed &= keep
    return scores, allowed


def draw(logp: Tensor, p: SamplingParams, position: int, stream: int = 0, seen: Tensor | None = None) -> Draw:
    """One token from one row of log-probabilities [V] at temperature p.report_temperature."""
    if p.temperature == 0:
        scores, allowed = allowed_tokens(logp, p, seen) if p.repetition_penalty != 1.0 else (logp, None)
        token = int(torch.argmax(scores if allowed is None else torch.where(allowed, scores, float("-inf"))))
    else:
        scores, allowed = allowed_tokens(logp, p, seen)
        gumbel = -log_float64(-log_float64(uniform_noise(p.seed, position, logp.numel(), logp.device, stream)))
        score = torch.where(allowed, scores.to(torch.float64) + gumbel,
                            torch.tensor(float("-inf"), dtype=torch.float64, device=logp.device))
        token = int(torch.argmax(score))
    top = []
    if p.logprobs:
        order = torch.sort(logp, descending=True, stable=True)
        top = list(zip(order.indices[:p.logprobs].tolist(), order.values[:p.logprobs].tolist()))
    return Draw(token, float(logp[token]), top)


def sample(hidden: Tensor, lm_head: Tensor, params: list[SamplingParams], positions: list[int],
           streams: list[int] | None = None, seen: list[Tensor | None] | None = None,
           softcap: float | None = None) -> list[Draw]:
    """The next token of each row of hidden [n, H]: one `vocab_logprobs` pass per temperature, then
    each row drawn from its own row alone, with its own (seed, stream, position); so the result is
    the same whatever other rows are present. seen[i]: a bool mask [V] of the tokens already in row
    i's context (for the repetition penalty). softcap: the model's final-logit softcapping."""
    streams = streams or [0] * len(params)
    seen = seen or [None] * len(params)
    draws: list[Draw | None] = [None] * len(params)
    temps = [p.report_temperature for p in params]
    for t in sorted(set(temps)):
        rows = [i for i, x in enumerate(temps) if x == t]
        logp = ops.vocab_logprobs(hidden[rows], lm_head, temperature=t, softcap=softcap)
        for j, i in enumerate(rows):
            draws[i] = draw(logp[j], params[i], positions[i], streams[i], seen[i])
    return draws  # type: ignore[return-value]
