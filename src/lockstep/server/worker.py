"""The engine's own thread: it owns the Engine, steps it while there is work, and hands each
request's tokens and completions back to the asyncio side through thread-safe callbacks.

Weight updates wait for the requests in flight to finish on the weights they began with (or, asked
to, abort them: each completion ends with finish_reason "abort" and the tokens it has); requests
that arrive meanwhile wait, and run on the new weights. No completion ever mixes two versions.

The weights have two names: `version`, an int that counts the updates applied (OpenAI answers'
`weights_version`), and `weight_version`, a label (SGLang's `meta_info.weight_version`): the one the
last update gave, else str(version). A job records both when it is admitted.
"""

from __future__ import annotations

import queue
import threading
import traceback
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine import Engine, RequestOutput
from ..model import logprobs, pack
from ..registry import use_backend
from ..sampling import Draw, SamplingParams


@dataclass
class Job:
    """One request: its prompt, how to sample it, and where its events go.

    on_token(output, draw) for every token drawn; on_done(outputs, version) once, with the n
    completions in index order, or on_error(message) if the engine failed. prompt_logprobs_from: when
    set, the logprobs of the prompt's tokens from that position on are computed at admission, on the
    weights the job runs on (prompt_logprobs[t] for token t, None for token 0), with the
    prompt_top_logprobs most likely alternatives at each position (prompt_top: [] at token 0)."""

    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[RequestOutput, Draw], None]
    on_done: Callable[[list[RequestOutput], int], None]
    on_error: Callable[[str], None]
    request_id: int | None = None
    version: int = 0
    weight_version: str = "0"
    tag: int = 0                                 # the caller's: which of its prompts this is
    prompt_logprobs_from: int | None = None
    prompt_top_logprobs: int = 0
    prompt_logprobs: dict[int, float | None] = field(default_factory=dict)
    prompt_top: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    outputs: dict[int, RequestOutput] = field(default_factory=dict)
    partial: dict[int, RequestOutput] = field(default_factory=dict)


@dataclass
class WeightUpdate:
    """What a weight update resolved to: the new version, its label, and the completions it aborted."""

    version: int
    weight_version: str
    aborted: int = 0


class WeightUpdateError(RuntimeError):
    """A weight update that failed (the old weights stay); `aborted` completions were cut short first."""

    def __init__(self, message: str, aborted: int = 0):
        super().__init__(message)
        self.aborted = aborted


def prompt_logprobs(model, prompt: list[int], temperature: float, start: int, top: int
                    ) -> tuple[dict[int, float | None], dict[int, list[tuple[int, float]]]]:
    """The logprob of prompt token t (t >= start) given the tokens before it, by the trainer's own
    path (`lockstep.logprobs`, so its bits are the trainer's), and the `top` most likely tokens at each
    position (the sampler's `vocab_logprobs`, ties to the lower id). Token 0 has none."""
    positions = range(max(start, 1), len(prompt))
    with torch.no_grad():
        lps = logprobs(model, [prompt], temperature=temperature)[0].tolist() if len(prompt) > 1 else []
        tops: dict[int, list[tuple[int, float]]] = {}
        if top and len(positions):
            ids, cu = pack([prompt], model.device)
            hidden = model(ids, cu)
            for lo in range(positions.start, positions.stop, 256):        # rows of the full vocabulary, 256 at a time
                rows = list(range(lo, min(lo + 256, positions.stop)))
                logp = model.vocab_logprobs(hidden[[t - 1 for t in rows]], temperature)
                order = torch.sort(logp, dim=-1, descending=True, stable=True)
                for j, t in enumerate(rows):
                    tops[t] = list(zip(order.indices[j, :top].tolist(), order.values[j, :top].tolist()))
    values: dict[int, float | None] = {t: lps[t - 1] for t in positions}
    if start == 0:
        values[0] = None
        tops[0] = []
    return values, tops


class EngineWorker:
    def __init__(self, engine: Engine, version: int = 0, backend: str = "auto", weight_version: str | None = None):
        self.engine, self.version, self.backend = engine, version, backend
        self.weight_version = weight_version if weight_version is not None else str(version)
        self.engine.on_token = self._on_token
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._waiting: list[Job] = []            # arrived during a weight update
        self._update: tuple[dict[str, torch.Tensor], str | None, int, Future] | None = None
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lockstep-engine", daemon=True)
        self.failure: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # --- from the asyncio side (any thread) ---------------------------------------------------
    def submit(self, job: Job) -> None:
        self._inbox.put(("submit", job))
        self._wake.set()

    def abort(self, job: Job) -> None:
        self._inbox.put(("abort", job))
        self._wake.set()

    def update_weights(self, tensors: dict[str, torch.Tensor], weight_version: str | None = None,
                       abort_all: bool = False) -> Future:
        """A future that resolves to a WeightUpdate once the weights are in (or to a WeightUpdateError). The
        requests in flight finish first on the old weights, or, with abort_all, end now with
        finish_reason "abort" (their outputs say so; WeightUpdate.aborted counts the completions)."""
        done: Future = Future()
        self._inbox.put(("update", (tensors, weight_version, abort_all, done)))
        self._wake.set()
        return done

    def flush_cache(self) -> Future:
        """A future that resolves to True once the prefix cache is forgotten, or to False if requests
        are in flight or waiting (SGLang's /flush_cache: only an idle server flushes)."""
        done: Future = Future()
        self._inbox.put(("flush", done))
        self._wake.set()
        return done

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    # --- the engine thread ----------------------------------------------------------------------
    def _admit(self, job: Job) -> None:
        job.version, job.weight_version = self.version, self.weight_version
        if job.prompt_logprobs_from is not None:
            try:
                job.prompt_logprobs, job.prompt_top = prompt_logprobs(
                    self.engine.model, job.prompt, job.params.report_temperature, job.prompt_logprobs_from,
                    job.prompt_top_logprobs)
            except Exception:                        # a bug, not a bad request: this job fails alone
                self.failure = traceback.format_exc()
                job.on_error("the prompt's logprobs failed; see the server log")
                return
        job.request_id = self.engine.add_request(job.prompt, job.params)
        self._jobs[job.request_id] = job

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                (self._waiting.append if self._update is not None else self._admit)(payload)
            elif kind == "abort":
                if payload in self._waiting:
                    self._waiting.remove(payload)
                elif payload.request_id in self._jobs:
                    self.engine.abort(payload.request_id)
                    del self._jobs[payload.request_id]
            elif kind == "update":
                tensors, label, abort_all, done = payload
                if self._update is not None:
                    self._settle(done, error=WeightUpdateError("another weight update is in progress"))
                else:
                    aborted = self._abort_all("aborted for a weight update (abort_all_requests)") if abort_all else 0
                    self._update = (tensors, label, aborted, done)
            elif kind == "flush":
                idle = not self.engine.has_unfinished() and not self._jobs and self._update is None
                if idle:                         # the scheduler alone changes the blocks
                    self.engine.scheduler.forget_prefixes()
                self._settle(payload, idle)

    @staticmethod
    def _settle(done: Future, result: object = None, error: BaseException | None = None) -> None:
        """Answer a caller's future. A caller that gave up (its asyncio task was cancelled, which
        cancels the future) must not take the engine thread down with InvalidStateError."""
        try:
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)
        except InvalidStateError:
            pass

    def _abort_all(self, reason: str) -> int:
        """End every job in flight now: each unfinished completion with finish_reason "abort", the
        tokens it has and `reason` as its error; the job's on_done gets all n. Returns how many
        completions were cut short."""
        cut = 0
        tokenizer = self.engine.model.tokenizer
        for request_id, job in list(self._jobs.items()):
            self.engine.abort(request_id)
            del self._jobs[request_id]
            outs = []
            for i in range(job.params.n):
                out = job.outputs.get(i)
                if out is None:
                    out = job.partial.get(i) or RequestOutput(request_id, list(job.prompt), index=i)
                    out.finish_reason, out.error = "abort", reason
                    if tokenizer is not None:
                        out.text = tokenizer.decode(out.token_ids)
                    cut += 1
                outs.append(out)
            job.on_done(outs, job.version)
        return cut

    def _apply_update(self) -> None:
        tensors, label, aborted, done = self._update
        self._update = None
        if not done.cancelled():                     # (a caller that gave up gets no update)
            try:
                self.engine.load_weights(tensors)
            except Exception as e:                   # the old weights stay
                self._settle(done, error=WeightUpdateError(str(e), aborted))
            else:
                self.version += 1
                self.weight_version = label if label is not None else str(self.version)
                self._settle(done, WeightUpdate(self.version, self.weight_version, aborted))
        for job in self._waiting:
            self._admit(job)
        self._waiting = []

    def _on_token(self, out: RequestOutput, draw: Draw) -> None:
        job = self._jobs.get(out.request_id)
        if job is not None:
            job.partial[out.index] = out
            job.on_token(out, draw)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue                             # aborted
            job.outputs[out.index] = out
            if len(job.outputs) == job.params.n:
                del self._jobs[out.request_id]
                job.on_done([job.outputs[i] for i in range(job.params.n)], job.version)

    def _run(self) -> None:
        try:
            with use_backend(self.backend):          # the backend is chosen per thread
                self._loop()
        except BaseException:                        # a bug: say so in /health rather than hang quietly
            self.failure = traceback.format_exc()
            for job in list(self._jobs.values()) + self._waiting:
                job.on_error("the engine thread stopped; see the server log")
            raise

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (before start and after stop: False)."""
        return self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if self._update is not None and not self.engine.has_unfinished():
                self._apply_update()
            if not self.engine.has_unfinished():
                self._deliver(self.engine.step())    # hands back requests refused at admission
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self._deliver(self.engine.step())
            except Exception:                        # a bug, not a bad request: fail what is in flight
                self.failure = traceback.format_exc()
                for job in list(self._jobs.values()):
                    job.on_error("the engine failed; see the server log")
                    self.engine.abort(job.request_id)
                self._jobs.clear()
