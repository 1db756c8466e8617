"""An inference engine for RL rollouts whose logprobs equal the trainer's bit for bit.

Continuous batching over a paged KV cache: requests join and finish between steps; each step packs
decode tokens and prefill chunks (under a token budget) into one `forward_cached` call. When the
cache is full, the most recently admitted request is preempted: its blocks are freed and it is
recomputed later from its prompt and the tokens it already produced. Because every op is
batch-invariant and attention is split-invariant, none of this changes a bit of any request's
tokens or logprobs, which is what `lockstep verify` checks.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .fixed_order import ceil_div
from .model import CacheStep, Transformer
from .sampling import SamplingParams, sample


@dataclass
class RequestOutput:
    """One finished completion. logprobs[i] is the logprob of token_ids[i] (see lockstep.sampling);
    top_logprobs[i] the (token, logprob) pairs most likely at that step, when asked for. A request
    with n completions gives n outputs with the same request_id and index 0..n-1."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None     # "stop", "length" or "error"
    error: str | None = None
    text: str | None = None
    index: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    out: RequestOutput
    blocks: list[int] = field(default_factory=list)
    computed: int = 0                     # tokens whose keys and values are in the cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out.token_ids

    @property
    def index(self) -> int:
        return self.out.index


class Engine:
    """Continuous-batching engine over a lockstep Transformer.

    max_num_seqs: requests running at once; max_num_batched_tokens: tokens per step (prefill chunks
    are cut to fit); block_size and num_blocks: the paged KV cache (default: room for max_num_seqs
    requests of the model's full context)."""

    def __init__(self, model: Transformer, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 block_size: int = 16, num_blocks: int | None = None):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.model = model
        self.max_num_seqs, self.budget, self.block_size = max_num_seqs, max_num_batched_tokens, block_size
        self.max_len = model.config.max_position_embeddings
        if num_blocks is None:
            num_blocks = max_num_seqs * ceil_div(min(self.max_len, 4096), block_size)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        self.cache = model.allocate_kv_cache(num_blocks, block_size)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        # Finished since the last `step()` returned; the engine keeps no output after handing it out.
        self._done: list[RequestOutput] = []
        self._next_id = 0
        self.stats = {"steps": 0, "preemptions": 0, "tokens": 0}

    # --- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | str, sampling: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. A bad request finishes at once with finish_reason "error"."""
        sampling = sampling or SamplingParams()
        rid = self._next_id
        self._next_id += 1
        try:
            ids = self._encode(prompt)
            sampling.validate(self.model.config.vocab_size)
            if len(ids) + sampling.max_new_tokens > self.max_len:
                raise ValueError(f"prompt: {len(ids)} tokens + max_new_tokens {sampling.max_new_tokens} exceed the "
                                 f"model's context of {self.max_len}")
            need = ceil_div(len(ids) + sampling.max_new_tokens, self.block_size)
            if need > len(self.free) + sum(len(r.blocks) for r in self.running):
                raise ValueError(f"prompt: needs {need} KV blocks, the cache has {len(self.cache.k[0])}")
            if sampling.stop and self.model.tokenizer is None:
                raise ValueError("stop: stop strings need a model with a tokenizer; use stop_token_ids")
        except (TypeError, ValueError) as e:
            n = sampling.n if isinstance(sampling.n, int) and 1 <= sampling.n <= SamplingParams.MAX_N else 1
            self._done.extend(RequestOutput(rid, [], finish_reason="error", error=str(e), index=i) for i in range(n))
            return rid
        for i in range(sampling.n):
            self.waiting.append(_Request(rid, ids, sampling, RequestOutput(rid, list(ids), index=i)))
        return rid

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.model.tokenizer is None:
                raise TypeError("prompt: a string needs a model with a tokenizer; pass token ids")
            ids = self.model.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: expected at least one token, got an empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids must be in [0, {vocab}), got {bad[:5]}")
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ---------------------------------------------------------------------------
    def _blocks_for(self, req: _Request, upto: int) -> int:
        return max(0, ceil_div(upto, self.block_size) - len(req.blocks))

    def _preempt(self, req: _Request) -> None:
        self.running.remove(req)
        self.free.extend(reversed(req.blocks))
        req.blocks, req.computed = [], 0
        self.waiting.insert(0, req)
        self.stats["preemptions"] += 1

    def _schedule(self) -> list[tuple[_Request, int]]:
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        plan: list[tuple[_Request, int]] = []
        for req in list(self.running):
            budget = self.budget - sum(k for _, k in plan)
            if req not in self.running or budget == 0:
                continue
            n = min(len(req.tokens) - req.computed, budget)
            need = self._blocks_for(req, req.computed + n)
            while need > len(self.free):
                victim = self.running[-1]
                if victim is req:
                    break
                self._preempt(victim)
                plan = [(r, k) for r, k in plan if r is not victim]
            if need > len(self.free):
                # Alone and still no room: wait for blocks freed by others (never happens when the
                # request was admitted, since add_request checks the whole cache).
                continue
            for _ in range(need):
                req.blocks.append(self.free.pop())
            plan.append((req, n))
        return plan

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batched forward step; returns the requests that finished since the last step
        (refused ones included)."""
        plan = self._schedule()
        if not plan:
            return self._take_done()
        device = self.model.device
        ids, pos, slots, cu, lens = [], [], [], [0], []
        width = max(len(r.blocks) for r, _ in plan)
        table = torch.zeros((len(plan), width), dtype=torch.int64)
        for i, (req, n) in enumerate(plan):
            span = range(req.computed, req.computed + n)
            ids.extend(req.tokens[req.computed:req.computed + n])
            pos.extend(span)
            slots.extend(req.blocks[p // self.block_size] * self.block_size + p % self.block_size for p in span)
            cu.append(cu[-1] + n)
            lens.append(req.computed + n)
            table[i, :len(req.blocks)] = torch.tensor(req.blocks)
        step = CacheStep(torch.tensor(cu), torch.tensor(lens), table.to(device), torch.tensor(slots, device=device))
        with torch.no_grad():
            hidden = self.model.forward_cached(torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                                               step, self.cache)
            rows, samplers, positions, reqs = [], [], [], []
            for i, (req, n) in enumerate(plan):
                req.computed += n
                if req.computed == len(req.tokens):          # its last token went through: sample
                    rows.append(cu[i + 1] - 1)
                    samplers.append(req.params)
                    positions.append(req.computed)           # position of the token being sampled
                    reqs.append(req)
            if rows:
                vocab = self.model.config.vocab_size
                seen = [_seen(r.tokens, vocab, hidden.device) if r.params.repetition_penalty != 1.0 else None
                        for r in reqs]
                draws = sample(hidden[rows], self.model.lm_head_weight, samplers, positions,
                               [r.index for r in reqs], seen)
                for req, d in zip(reqs, draws):
                    if not math.isfinite(d.logprob):
                        # NaN or Inf logits sample garbage; the row is this request's alone, so only it stops.
                        self._finish(req, "error", f"the logits at position {req.computed} are not finite (NaN or "
                                                   "Inf); the request was stopped there")
                        continue
                    req.out.token_ids.append(d.token)
                    req.out.logprobs.append(d.logprob)
                    if req.params.logprobs:
                        req.out.top_logprobs.append(d.top)
                    self.stats["tokens"] += 1
                    stop_string = self._stop_string(req)
                    if d.token in req.params.stop_token_ids:
                        req.out.stop_reason = d.token
                        self._finish(req, "stop")
                    elif stop_string is not None:
                        req.out.stop_reason = stop_string
                        self._finish(req, "stop")
                    elif len(req.out.token_ids) >= req.params.max_new_tokens:
                        self._finish(req, "length")
        self.stats["steps"] += 1
        return self._take_done()

    def _stop_string(self, req: _Request) -> str | None:
        """The first of the request's stop strings that its text now holds; the text is cut before it
        (the stop string is not part of a completion's text, as in OpenAI's API)."""
        if not req.params.stop:
            return None
        text = self.model.tokenizer.decode(req.out.token_ids)
        found = [(text.find(s), s) for s in req.params.stop if s in text]
        if not found:
            return None
        at, stop = min(found)
        req.out.text = text[:at]
        return stop

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        req.out.finish_reason, req.out.error = reason, error
        if self.model.tokenizer is not None and req.out.text is None:
            req.out.text = self.model.tokenizer.decode(req.out.token_ids)
        self.running.remove(req)
        self.free.extend(reversed(req.blocks))
        req.blocks = []
        self._done.append(req.out)

    def _take_done(self) -> list[RequestOutput]:
        out, self._done = self._done, []
        return out

    # --- conveniences -------------------------------------------------------------------------
    def stream(self) -> Iterator[RequestOutput]:
        """Yield requests as they finish, stepping until none is left."""
        yield from self._take_done()
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Sequence, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts (token-id lists, or strings with a tokenizer) to completion. Returns the outputs in
        prompt order; a prompt sampled with n > 1 gives its n completions in a row (index 0..n-1)."""
        if isinstance(sampling, SamplingParams) or sampling is None:
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"sampling: expected one SamplingParams or {len(prompts)}, got {len(sampling)}")
        ids = [self.add_request(p, s) for p, s in zip(prompts, sampling)]
        wanted = [(rid, i) for rid, s in zip(ids, sampling) for i in range(s.n if _int_n(s.n) else 1)]
        by_key = {(o.request_id, o.index): o for o in self._take_done()}
        started, shown = time.time(), 0.0
        while self.has_unfinished():
            by_key.update(((o.request_id, o.index), o) for o in self.step())
            if progress and time.time() - shown > 0.5:
                shown = time.time()
                rate = self.stats["tokens"] / max(1e-9, shown - started)
                done = sum(k in by_key for k in wanted)
                print(f"\r[engine] {done}/{len(wanted)} done, {self.stats['tokens']} tokens, {rate:.0f} tok/s",
                      end="", file=sys.stderr, flush=True)
        mine = set(wanted)
        if progress:
            print(f"\r[engine] {len(mine)}/{len(wanted)} done, {self.stats['tokens']} tokens", file=sys.stderr)
        # Requests added before this call finished too: their outputs wait for the next step() or stream().
        self._done.extend(o for key, o in by_key.items() if key not in mine)
        return [by_key[k] for k in wanted]


def _int_n(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= SamplingParams.MAX_N


def _seen(tokens: list[int], vocab: int, device) -> torch.Tensor:
    """A bool mask [vocab] of the tokens that occur in `tokens`."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(tokens, dtype=torch.int64, device=device)] = True
    return mask
