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
a draw does not follow the CPU's vector unit either. Which tokens are allowed, and how likely, is
shaped in this order: the repetition penalty, then top-k, min-p and top-p. The reported logprob
(and the top-N alternatives) are those of the temperature-scaled distribution *before* that
shaping, because that is what a trainer recomputes from the model.

All rows of a step are drawn together on the logits' device, each by row-wise ops alone, and their
results come back to the host in two reads (the tokens with the top-N ids, the logprobs with the
top-N values), whatever the number of rows or their parameters (docs/adr/0035). `draw` is that
path with one row.
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


def _mix32_int(x: int) -> int:
    """`_mix32` on a Python int in [0, 2^32): the same integer arithmetic, on the host."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _noise_key(seed: int, position: int, stream: int) -> tuple[int, int]:
    """The two 32-bit keys of a row's noise. They depend on no token, so they are hashed on the
    host: a row's keys reach the device with its parameters and no data comes back."""
    key = _mix32_int(((seed * 0x9E3779B1) & _MASK32) ^ (position & _MASK32))
    if stream:
        key = _mix32_int(key ^ ((stream * 0x85EBCA77) & _MASK32))
    return key, _mix32_int(key ^ 0x5BD1E995)


def _uniform_rows(keys: list[tuple[int, int]], vocab_size: int, device: torch.device | str) -> Tensor:
    """u in (0, 1), float64 [len(keys), vocab_size]: row i from the keys `_noise_key` gave."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    k = torch.tensor(keys, dtype=torch.int64, device=device).reshape(-1, 2)
    a = _mix32(ids ^ k[:, :1])
    b = _mix32(a ^ k[:, 1:])
    bits = a * 2 ** 21 + (b >> 11)       # 53 random bits
    return (bits.to(torch.float64) + 0.5) / 2.0 ** 53


def uniform_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu",
                  stream: int = 0) -> Tensor:
    """u in (0, 1), float64 [vocab_size], a pure function of (seed, stream, position, token id).
    stream 0 is a request's first completion; completion i of n uses stream i."""
    return _uniform_rows([_noise_key(seed, position, stream)], vocab_size, device)[0]


@dataclass
class Draw:
    """What the sampler drew for one row: the token, its logprob, and (when asked) the top-N
    (token, logprob) pairs, most likely first, ties broken by the lower token id."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def probabilities(scores: Tensor, allowed: Tensor) -> Tensor:
    """softmax over the last dimension of the allowed scores [..., V] (float32), for top-p. Its exp
    runs on the CPU backend's kernels: PyTorch's float32 exp can follow the instruction set (MKL's
    vector math on Intel, docs/adr/0010), which could move a token across the top-p line."""
    return exp(ops.log_softmax(torch.where(allowed, scores, float("-inf"))), kernels=cpu_backend_kernel_set())


def _column(values: list, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """One value per row, [n, 1], on `like`'s device. A float column takes `like`'s dtype: a Python
    scalar in a float32 op is rounded to float32 first, so per-row thresholds in float32 give the
    bits the scalar did."""
    return torch.tensor(values, dtype=dtype or like.dtype, device=like.device).reshape(-1, 1)


def _rows_of(x: Tensor, index: Tensor | None) -> Tensor:
    return x if index is None else x.index_select(0, index)


def _index(rows: list[int], n: int, device: torch.device) -> Tensor | None:
    """The rows' indices on the device, or None when they are all n rows (then nothing is copied)."""
    return None if len(rows) == n else torch.tensor(rows, dtype=torch.int64, device=device)


def _running_sums(x: Tensor) -> Tensor:
    """The inclusive running sums along the rows of x [m, V] (float32), each row's from that row
    alone. On the CPU, torch.cumsum: each row's own sequential sum in double, rounded at each entry,
    the bits of the 1-D sum (and of the draws recorded before rows were drawn together). Elsewhere
    PyTorch's scans are no such thing: CUDA's sums a single row with cub's decoupled look-back, which
    PyTorch lists as nondeterministic for floats, and several rows with a tree whose width follows
    the number of rows. So off the CPU the sums are a Hillis-Steele scan in float64 of explicit
    additions, whose order depends on V alone, rounded to x's dtype (docs/adr/0035)."""
    if x.device.type == "cpu":
        return torch.cumsum(x, dim=-1)
    return _scan(x.to(torch.float64)).to(x.dtype)


def _scan(acc: Tensor) -> Tensor:
    """Inclusive running sums along the last dimension of acc [m, V] by log2(V) rounds of adding
    the entry `shift` to the left: a fixed order of correctly rounded additions, so the same bits
    on every device and for every m."""
    shift = 1
    while shift < acc.shape[-1]:
        acc = torch.cat([acc[:, :shift], acc[:, shift:] + acc[:, :-shift]], dim=-1)
        shift *= 2
    return acc


def _shape(logp: Tensor, params: list[SamplingParams], seen: Tensor | None) -> tuple[Tensor, Tensor]:
    """(scores, allowed), [n, V] of logp's dtype and bool, for rows of log-probabilities [n, V]
    (float32 or float64): each row's repetition penalty applied to its scores, then its top-k,
    min-p and top-p restrict its allowed set. seen: bool [n, V] or None. Every op is row-wise, so a
    row's result does not depend on the other rows; a row whose option is off is left as it is."""
    n, vocab = logp.shape
    device = logp.device
    scores = logp
    penalized = [p.repetition_penalty != 1.0 for p in params]
    if seen is not None and any(penalized):
        log_r = _column([exact_math.log(p.repetition_penalty) if f else 0.0 for p, f in zip(params, penalized)], logp)
        scores = torch.where(seen & _column(penalized, logp, torch.bool), logp - log_r, logp)
    allowed = torch.isfinite(scores)

    k = [min(p.top_k, vocab) for p in params]
    rows = [i for i in range(n) if k[i]]
    if rows:
        index = _index(rows, n, device)
        values = torch.topk(_rows_of(scores, index), max(k)).values            # descending
        kth = values.gather(1, _column([k[i] - 1 for i in rows], values, torch.int64))
        if index is not None:
            # -inf lets every finite score of a row without top-k through, and `allowed` already
            # holds only finite ones.
            kth = torch.full((n, 1), float("-inf"), dtype=kth.dtype, device=device).index_copy(0, index, kth)
        allowed = allowed & (scores >= kth)

    min_p = [p.min_p > 0 for p in params]
    if any(min_p):
        log_min_p = _column([exact_math.log(p.min_p) if f else 0.0 for p, f in zip(params, min_p)], logp)
        floor = torch.amax(scores, dim=-1, keepdim=True) + log_min_p
        # where, not arithmetic: a row without min-p must not see its amax (NaN, or inf - inf).
        floor = torch.where(_column(min_p, logp, torch.bool), floor, float("-inf"))
        allowed = allowed & (scores >= floor)

    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        index = _index(rows, n, device)
        sub_allowed = _rows_of(allowed, index)
        probs = probabilities(_rows_of(scores, index), sub_allowed)
        order = torch.argsort(probs, dim=-1, descending=True, stable=True)
        ranked = probs.gather(1, order)
        before = _running_sums(ranked) - ranked
        kept = before < _column([params[i].top_p for i in rows], probs)
        keep = torch.zeros_like(sub_allowed).scatter_(1, order, kept)
        if index is None:
            allowed = allowed & keep
        else:
            allowed = allowed.index_copy(0, index, sub_allowed & keep)
    return scores, allowed


def allowed_tokens(logp: Tensor, p: SamplingParams, seen: Tensor | None) -> tuple[Tensor, Tensor]:
    """(scores, allowed) for one row of log-probabilities [V] (float32): the repetition penalty
    applied to the scores, then top-k, min-p and top-p restrict the allowed set."""
    scores, allowed = _shape(logp[None], [p], None if seen is None else seen[None])
    return scores[0], allowed[0]


_UNSHAPED = SamplingParams()


def draw_rows(logp: Tensor, params: list[SamplingParams], positions: list[int], streams: list[int] | None = None,
              seen: Tensor | None = None) -> list[Draw]:
    """One token from each row of log-probabilities [n, V] (float32 or float64, each row at its
    params' report_temperature), drawn on logp's device; row i with params[i]'s noise stream
    (seed, streams[i]) at positions[i]. seen: bool [n, V] of the tokens in each row's context, or
    None. Two reads of tensor data in all: the tokens with the top-N ids, then the logprobs with
    the top-N values."""
    n, vocab = logp.shape
    device = logp.device
    if n == 0:
        return []
    streams = [0] * n if streams is None else streams
    # Greedy without a penalty is the plain argmax of logp: its truncations keep the first maximum,
    # and a NaN row's argmax is its first NaN, as it always was.
    shaped = [p.temperature > 0 or p.repetition_penalty != 1.0 for p in params]
    scores, allowed = _shape(logp, [p if s else _UNSHAPED for p, s in zip(params, shaped)], seen)
    if not all(shaped):
        allowed = allowed | ~_column(shaped, logp, torch.bool)
    score = scores.to(torch.float64)
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    if hot:
        keys = [_noise_key(params[i].seed, positions[i], streams[i]) for i in hot]
        gumbel = -log_float64(-log_float64(_uniform_rows(keys, vocab, device)))
        index = _index(hot, n, device)
        if index is None:
            score = score + gumbel
        else:
            score = score.index_copy(0, index, score.index_select(0, index) + gumbel)
    # argmax takes the first of equal maxima: ties go to the lower token id.
    token = torch.argmax(torch.where(allowed, score, float("-inf")), dim=-1, keepdim=True)
    ids, values = token, logp.gather(1, token)

    wanted = [p.logprobs for p in params]
    rows = [i for i in range(n) if wanted[i]]
    if rows:
        index = _index(rows, n, device)
        # A stable sort, not topk: equal logprobs are listed by token id.
        order = torch.sort(_rows_of(logp, index), dim=-1, descending=True, stable=True)
        top_ids, top_values = order.indices[:, :max(wanted)], order.values[:, :max(wanted)]
        if index is not None:
            top_ids = torch.zeros((n, top_ids.shape[1]), dtype=top_ids.dtype, device=device).index_copy(0, index, top_ids)
            top_values = torch.zeros((n, top_values.shape[1]), dtype=top_values.dtype,
                                     device=device).index_copy(0, index, top_values)
        ids, values = torch.cat([ids, top_ids], dim=1), torch.cat([values, top_values], dim=1)
    ids, values = ids.tolist(), values.tolist()
    return [Draw(i[0], v[0], list(zip(i[1:1 + w], v[1:1 + w]))) for i, v, w in zip(ids, values, wanted)]


def draw(logp: Tensor, p: SamplingParams, position: int, stream: int = 0, seen: Tensor | None = None) -> Draw:
    """One token from one row of log-probabilities [V] at temperature p.report_temperature: the
    batched draw with one row. seen: bool [V] or None."""
    return draw_rows(logp[None], [p], [position], [stream], None if seen is None else seen[None])[0]


def _seen_rows(seen: Tensor | list[Tensor | None] | None, n: int, vocab: int,
               device: torch.device) -> Tensor | None:
    """seen as one bool [n, V] tensor (a row without a mask has none seen), or None."""
    if seen is None or isinstance(seen, Tensor):
        return seen
    if all(m is None for m in seen):
        return None
    none = torch.zeros(vocab, dtype=torch.bool, device=device)
    return torch.stack([none if m is None else m.to(device=device, dtype=torch.bool) for m in seen])


def sample(hidden: Tensor, lm_head: Tensor, params: list[SamplingParams], positions: list[int],
           streams: list[int] | None = None, seen: Tensor | list[Tensor | None] | None = None,
           softcap: float | None = None) -> list[Draw]:
    """The next token of each row of hidden [n, H]: one `vocab_logprobs` pass per temperature, then
    all rows drawn together (`draw_rows`), each from its own row alone with its own (seed, stream,
    position); so the result is the same whatever other rows are present. seen: per row a bool mask
    [V] of the tokens already in its context, or None (for the repetition penalty), or one bool
    [n, V] tensor. softcap: the model's final-logit softcapping. Reads tensor data twice in all."""
    n = len(params)
    if n == 0:
        return []
    temps = [p.report_temperature for p in params]
    parts = []
    for t in sorted(set(temps)):
        rows = [i for i, x in enumerate(temps) if x == t]
        parts.append((rows, ops.vocab_logprobs(hidden[rows], lm_head, temperature=t, softcap=softcap)))
    if len(parts) == 1:
        logp = parts[0][1]
    else:
        first = parts[0][1]
        logp = torch.empty((n, first.shape[-1]), dtype=first.dtype, device=first.device)
        for rows, part in parts:
            logp.index_copy_(0, torch.tensor(rows, dtype=torch.int64, device=logp.device), part)
    return draw_rows(logp, params, positions, streams, _seen_rows(seen, n, logp.shape[-1], logp.device))
