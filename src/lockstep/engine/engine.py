"""The engine loop: requests in, one scheduled model step at a time, finished completions out.

Continuous batching over a paged KV cache: sequences join and finish between steps; each step packs
decode tokens and prefill chunks (under a token budget) into one `forward_cached` call
(Scheduler), over blocks that full prompt prefixes share (BlockManager, which only the Scheduler
changes), through one input builder (ModelRunner and lockstep.paged_cache.build_step). Because
every op is batch-invariant and attention is split-invariant, none of this changes a bit of any
request's tokens or logprobs, which is what `lockstep verify` checks.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from typing import Callable, Iterator
from typing import Sequence as Seq

import torch

from .. import checks
from ..numerics.fixed_order import ceil_div
from ..model import Transformer
from ..sampling import Draw, SamplingParams
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .requests import RequestLimits, encode_prompt, validate_request
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence


class Engine:
    """Continuous-batching engine over a lockstep Transformer.

    max_num_seqs: sequences running at once; max_num_batched_tokens: tokens per step (prefill chunks
    are cut to fit); block_size and num_blocks: the paged KV cache (default: room for max_num_seqs
    sequences of the model's full context, up to 4096 tokens each); prefix_caching: share the full
    blocks of equal prompt prefixes. on_token(output, draw) is called for every token drawn (the
    server streams from it). static_decode: steps that only decode run on static buffers per
    batch-size bucket, padded with rows in scratch blocks (engine.model_runner.DecodeBuffers); the
    bits are the same either way. cuda_graphs: on a CUDA device, each bucket's decode forward is
    captured in a CUDA graph and replayed (needs static_decode; not for sparse MoE models, whose
    layers read their experts' token counts). cpu_graphs: on the CPU, with static_decode, each
    bucket's decode forward is recorded on its second step and its kernel calls replayed after, with
    the same bits and without the Python around them; a step that cannot be replayed runs eagerly
    (engine.step_graph)."""

    def __init__(self, model: Transformer, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 block_size: int = 16, num_blocks: int | None = None, prefix_caching: bool = True,
                 on_token: Callable[[RequestOutput, Draw], None] | None = None, static_decode: bool = True,
                 cuda_graphs: bool = False, cpu_graphs: bool = True):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)):
            checks.int_at_least(name, value)
        self.model = model
        self.max_len = model.config.max_position_embeddings
        if num_blocks is None:
            num_blocks = max_num_seqs * ceil_div(min(self.max_len, 4096), block_size)
        checks.int_at_least("num_blocks", num_blocks)
        if not isinstance(static_decode, bool):
            raise ValueError(f"static_decode: expected True or False, got {static_decode!r}")
        for name, flag in (("cuda_graphs", cuda_graphs), ("cpu_graphs", cpu_graphs)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected True or False, got {flag!r}")
        if cuda_graphs and (model.device.type != "cuda" or not static_decode or model.config.num_experts):
            why = (f"the model is on {model.device.type}, and they need a CUDA device" if model.device.type != "cuda"
                   else "they replay static decode steps: pass static_decode=True" if not static_decode
                   else "a sparse MoE layer reads its experts' token counts to the host, which a graph cannot replay")
            raise ValueError(f"cuda_graphs: CUDA graphs cannot be used here: {why}")
        self.block_size = block_size
        # What every request is checked against (lockstep.engine.requests), here and in `lockstep serve`.
        self.limits = RequestLimits(model.config.vocab_size, self.max_len, block_size, num_blocks)
        self.scheduler = Scheduler(BlockManager(num_blocks, block_size, prefix_caching), max_num_seqs,
                                   max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks, block_size, max_num_seqs if static_decode else None,
                                  self.max_len, cuda_graphs, cpu_graphs)
        self.on_token = on_token
        # Finished since the last `step()` returned; the engine keeps no output after handing it out.
        self._done: list[RequestOutput] = []
        self._next_id = 0
        self._steps = self._tokens = 0

    @property
    def blocks(self) -> BlockManager:
        """The KV cache's blocks, to read (num_blocks, num_free, hits): the scheduler alone changes them."""
        return self.scheduler.blocks

    @property
    def stats(self) -> dict[str, int]:
        """steps run, tokens drawn, preemptions, and prompt tokens served from the prefix cache."""
        return {"steps": self._steps, "tokens": self._tokens, "preemptions": self.scheduler.preemptions,
                "cached_tokens": self.blocks.hits}

    # --- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: Seq[int] | str, sampling: SamplingParams | None = None) -> int:
        """Queue a request (n completions); returns its id. A bad request (lockstep.engine.requests:
        the check `lockstep serve` runs too) finishes at once, every one of its completions with
        finish_reason "error" and the check's message."""
        sampling = sampling or SamplingParams()
        rid = self._next_id
        self._next_id += 1
        try:
            ids = validate_request(self.limits, self.model.tokenizer, prompt, sampling)
        except (TypeError, ValueError) as e:
            n = sampling.n if _valid_n(getattr(sampling, "n", 1)) else 1
            self._done.extend(RequestOutput(rid, [], finish_reason="error", error=str(e), index=i) for i in range(n))
            return rid
        for i in range(sampling.n):
            self.scheduler.add(Sequence(rid, ids, sampling, RequestOutput(rid, list(ids), index=i)))
        return rid

    def encode(self, prompt: Seq[int] | str) -> list[int]:
        """A prompt as token ids (a string through the model's tokenizer), checked against the vocabulary;
        an InvalidRequest (a ValueError, "prompt: ...") otherwise. Deprecated: use
        lockstep.engine.requests.encode_prompt(prompt, model.tokenizer, model.config.vocab_size)."""
        warnings.warn("Engine.encode is deprecated; use lockstep.engine.requests.encode_prompt(prompt, "
                      "model.tokenizer, model.config.vocab_size)", DeprecationWarning, stacklevel=2)
        return encode_prompt(prompt, self.model.tokenizer, self.model.config.vocab_size)

    def abort(self, request_id: int) -> None:
        """Stop a request now (a client that went away): its blocks are freed, its outputs dropped."""
        for seq in self.scheduler.abort(request_id):
            seq.out.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batched forward step; returns the completions that finished since the last step
        (refused ones included)."""
        plan = self.scheduler.schedule()
        if not plan:
            return self._take_done()
        for seq, draw in self.runner.run(plan):
            self._accept(seq, draw)
        self.scheduler.postprocess(plan)
        self._steps += 1
        return self._take_done()

    def _accept(self, seq: Sequence, draw: Draw) -> None:
        if not math.isfinite(draw.logprob):
            # NaN or Inf logits sample garbage; the row is this sequence's alone, so only it stops.
            self._finish(seq, "error", f"the logits at position {seq.computed} are not finite (NaN or Inf); the "
                                       "request was stopped there")
            return
        out, params = seq.out, seq.params
        out.token_ids.append(draw.token)
        out.logprobs.append(draw.logprob)
        if params.logprobs:
            out.top_logprobs.append(draw.top)
        self._tokens += 1
        if self.on_token is not None:
            self.on_token(out, draw)
        stop_string = self._stop_string(seq)
        if draw.token in params.stop_token_ids:
            out.stop_reason = draw.token
            self._finish(seq, "stop")
        elif stop_string is not None:
            out.stop_reason = stop_string
            self._finish(seq, "stop")
        elif len(out.token_ids) >= params.max_new_tokens:
            self._finish(seq, "length")

    def _stop_string(self, seq: Sequence) -> str | None:
        """The first of the sequence's stop strings that its text now holds; the text is cut before it
        (the stop string is not part of a completion's text, as in OpenAI's API)."""
        if not seq.params.stop:
            return None
        text = self.model.tokenizer.decode(seq.out.token_ids)
        found = [(text.find(s), s) for s in seq.params.stop if s in text]
        if not found:
            return None
        at, stop = min(found)
        seq.out.text = text[:at]
        return stop

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.out.finish_reason, seq.out.error = reason, error
        if self.model.tokenizer is not None and seq.out.text is None:
            seq.out.text = self.model.tokenizer.decode(seq.out.token_ids)
        self.scheduler.finish(seq)
        self._done.append(seq.out)

    def _take_done(self) -> list[RequestOutput]:
        out, self._done = self._done, []
        return out

    # --- weights ------------------------------------------------------------------------------
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the model between steps (no request may be running: every cached
        key and value would be stale). The prefix cache is forgotten."""
        if self.has_unfinished():
            raise RuntimeError("load_weights: requests are running; finish or abort them first")
        own = dict(self.model.named_parameters())
        missing = sorted(set(own) - set(tensors))
        extra = sorted(set(tensors) - set(own))
        shapes = [n for n in own if n in tensors and tuple(tensors[n].shape) != tuple(own[n].shape)]
        if missing or extra or shapes:
            raise ValueError(f"weights: do not fit the model (missing {missing[:5]}, unexpected {extra[:5]}, "
                             f"mis-shaped {shapes[:5]})")
        # Every tensor is converted before any is copied: a failure on the way (out of memory, say)
        # leaves the old weights whole rather than half replaced. It costs one model's worth of
        # memory during the update.
        ready = {name: tensors[name].to(dtype=p.dtype, device=p.device) for name, p in own.items()}
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(ready[name])
        self.scheduler.forget_prefixes()

    # --- conveniences -------------------------------------------------------------------------
    def stream(self) -> Iterator[RequestOutput]:
        """Yield completions as they finish, stepping until none is left."""
        yield from self._take_done()
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Seq, sampling: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts (token-id lists, or strings with a tokenizer) to completion. Returns the outputs in
        prompt order; a prompt sampled with n > 1 gives its n completions in a row (index 0..n-1)."""
        if isinstance(sampling, SamplingParams) or sampling is None:
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"sampling: expected one SamplingParams or {len(prompts)}, got {len(sampling)}")
        ids = [self.add_request(p, s) for p, s in zip(prompts, sampling)]
        wanted = [(rid, i) for rid, s in zip(ids, sampling) for i in range(s.n if _valid_n(s.n) else 1)]
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


def _valid_n(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= SamplingParams.MAX_N
