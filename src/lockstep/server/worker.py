"""The engine's own thread: it owns the Engine, steps it while there is work, and hands each
request's tokens and completions back to the asyncio side through thread-safe callbacks.

Weight updates wait for the requests in flight to finish on the weights they began with; requests
that arrive meanwhile wait, and run on the new weights. No completion ever mixes two versions.
"""

from __future__ import annotations

import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine import Engine, RequestOutput
from ..registry import use_backend
from ..sampling import Draw, SamplingParams


@dataclass
class Job:
    """One request: its prompt, how to sample it, and where its events go.

    on_token(output, draw) for every token drawn; on_done(outputs) once, with the n completions in
    index order, or on_error(message) if the engine failed."""

    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[RequestOutput, Draw], None]
    on_done: Callable[[list[RequestOutput], int], None]
    on_error: Callable[[str], None]
    request_id: int | None = None
    version: int = 0
    outputs: dict[int, RequestOutput] = field(default_factory=dict)


class EngineWorker:
    def __init__(self, engine: Engine, version: int = 0, backend: str = "auto"):
        self.engine, self.version, self.backend = engine, version, backend
        self.engine.on_token = self._on_token
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._waiting: list[Job] = []            # arrived during a weight update
        self._update: tuple[dict[str, torch.Tensor], Future] | None = None
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

    def update_weights(self, tensors: dict[str, torch.Tensor]) -> Future:
        """A future that resolves to the new version once the weights are in (or to the error)."""
        done: Future = Future()
        self._inbox.put(("update", (tensors, done)))
        self._wake.set()
        return done

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    # --- the engine thread ----------------------------------------------------------------------
    def _admit(self, job: Job) -> None:
        job.version = self.version
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
                if self._update is not None:
                    payload[1].set_exception(RuntimeError("another weight update is in progress"))
                else:
                    self._update = payload

    def _apply_update(self) -> None:
        tensors, done = self._update
        self._update = None
        try:
            self.engine.load_weights(tensors)
        except Exception as e:                       # the old weights stay
            done.set_exception(e)
        else:
            self.version += 1
            done.set_result(self.version)
        for job in self._waiting:
            self._admit(job)
        self._waiting = []

    def _on_token(self, out: RequestOutput, draw: Draw) -> None:
        job = self._jobs.get(out.request_id)
        if job is not None:
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
        with use_backend(self.backend):          # the backend is chosen per thread
            self._loop()

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
