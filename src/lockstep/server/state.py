"""The server's state, which every route reads from `request.app.state.server`: the model, the engine
thread, and turning requests into engine jobs and their events back into answers.

Requests are checked by `lockstep.engine.requests` (the engine's own check) before anything is
queued; its InvalidRequest becomes a RequestError: a 400 whose `param` is the field as the route's
API names it.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Callable, Mapping

import torch
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ..engine import Engine, RequestOutput
from ..engine.requests import InvalidRequest, encode_prompt, validate_request
from ..model import Transformer
from ..sampling import SamplingParams
from ..model.chat_template import ChatTemplate
from . import compat
from .protocol import error_body
from .worker import EngineWorker, Job, WeightUpdateError


class RequestError(Exception):
    """A request the server refuses: an HTTP status, the offending field and why."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def fail(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    """An error answer: OpenAI's error body, which names the field."""
    return JSONResponse(error_body(message, param, kind), status_code=status)


def update_refused(message: str, param: str, aborted: int = 0) -> JSONResponse:
    """A weight update refused (a 400): SGLang's fields (success false, message, num_paused_requests)
    and the error body that names the field."""
    body = {**error_body(message, param), "success": False, "message": message, "num_paused_requests": aborted}
    return JSONResponse(body, status_code=400)


def describe_validation_error(err: dict, prefix: str = "") -> tuple[str, str]:
    """(param, message) of one pydantic error: the field's dotted path (under `prefix`) and why."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(([prefix] if prefix else []) + loc) or "body"
    if err.get("type") == "extra_forbidden":
        return param, f"{param}: unknown field"
    return param, f"{param}: {err.get('msg')}"


def refuse_unsupported(body: BaseModel, accepted: Mapping[str, tuple], prefix: str = "") -> None:
    """A 400 naming the first field of `accepted` (a table of compat.py) whose value in `body` lockstep
    does not accept, and what it accepts: "echo: only false is supported, got true"."""
    found = compat.unsupported(body, accepted, prefix)
    if found is not None:
        raise RequestError(400, found[1], found[0])


class Server:
    """The model, its engine thread, and what the HTTP handlers need to turn requests into jobs.

    model_path: what /get_model_info reports (the checkpoint served; after an update from disk, that
    update's folder)."""

    def __init__(self, model: Transformer, name: str, engine_kwargs: dict, model_dir: str | None = None,
                 api_key: str | None = None, load_weights: Callable[[str], dict[str, torch.Tensor]] | None = None,
                 backend: str = "auto", model_path: str | None = None):
        self.model, self.name, self.api_key = model, name, api_key
        self.tokenizer = model.tokenizer
        self.chat_template = ChatTemplate.for_tokenizer(self.tokenizer, model_dir)
        self.context = model.config.max_position_embeddings
        self.worker = EngineWorker(Engine(model, **engine_kwargs), backend=backend)
        self.load_weights = load_weights
        self.model_path = model_path or model_dir or name
        self.tokenizer_path = getattr(self.tokenizer, "folder", None) or model_dir or self.model_path

    # --- prompts and sampling -------------------------------------------------------------------
    def text_of(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"<{token}>"

    def encode(self, prompt, param: str) -> list[int]:
        """A prompt's token ids; a 400 naming `param` if it is not one."""
        try:
            return encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size, param)
        except InvalidRequest as e:
            raise RequestError(400, str(e), e.field) from None

    def check(self, prompt: list[int], params: SamplingParams, names: Mapping[str, str]) -> None:
        """The engine's own check of a request (lockstep.engine.requests); a 400 naming the field as
        `names` spell the engine's names in this API."""
        try:
            engine = self.worker.engine
            validate_request(engine.limits, engine.model.tokenizer, prompt, params, names)
        except InvalidRequest as e:
            raise RequestError(400, str(e), e.field) from None

    def room(self, prompts: list[list[int]]) -> int:
        """New tokens the longest prompt leaves in the context and in the KV cache, which may be
        smaller (at least 1, so that a prompt too long is refused by the check, naming the prompt):
        the default budget of a request that names none."""
        limits = self.worker.engine.limits
        capacity = min(self.context, limits.num_blocks * limits.block_size)
        return max(1, capacity - max(len(p) for p in prompts))

    def finish_sampling(self, params: SamplingParams, ignore_eos: bool, seeded: bool) -> SamplingParams:
        """Stop at the model's end-of-sequence tokens unless ignore_eos; draw a seed unless given."""
        eos = self.model.config.eos_token_id
        if not ignore_eos and eos is not None:
            params.stop_token_ids += [t for t in (eos if isinstance(eos, list) else [eos])
                                      if t not in params.stop_token_ids]
        if not seeded:
            params.seed = secrets.randbelow(2 ** 31)
        return params

    # --- jobs -----------------------------------------------------------------------------------
    def start(self, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
              events: asyncio.Queue | None = None, tag: int = 0, prompt_logprobs_from: int | None = None,
              prompt_top_logprobs: int = 0) -> tuple[Job, asyncio.Queue]:
        """Submit one prompt; its events arrive on `events` (a new queue unless given), each with the
        job's tag: ("token", tag, index, draw, cached_tokens) for each token, then
        ("done", tag, outputs, version) or ("error", tag, message)."""
        events = events if events is not None else asyncio.Queue()

        def put(*event):
            loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(prompt, params, on_token=lambda out, draw: put("token", tag, out.index, draw, out.cached_tokens),
                  on_done=lambda outs, version: put("done", tag, outs, version),
                  on_error=lambda msg: put("error", tag, msg), tag=tag, prompt_logprobs_from=prompt_logprobs_from,
                  prompt_top_logprobs=prompt_top_logprobs)
        self.worker.submit(job)
        return job, events

    def abort(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.worker.abort(job)                 # a no-op once done; a client gone frees its blocks

    async def collect(self, request: Request, jobs: list[Job], events: asyncio.Queue
                      ) -> dict[int, tuple[list[RequestOutput], int]]:
        """Wait for every job (their events all on `events`): tag -> (outputs, version). Abort them all
        if the client goes away or the engine fails."""
        done: dict[int, tuple[list[RequestOutput], int]] = {}
        loop = asyncio.get_running_loop()
        next_check = loop.time() + 1.0
        try:
            while len(done) < len(jobs):
                try:
                    event = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    event = None
                if loop.time() >= next_check:        # between tokens too: they arrive every step
                    next_check = loop.time() + 1.0
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
                if event is None:
                    continue
                if event[0] == "done":
                    done[event[1]] = (event[2], event[3])
                elif event[0] == "error":
                    raise RequestError(500, f"engine: {event[2]}")
        except BaseException:
            self.abort(jobs)
            raise
        return done

    def decode_delta(self, tokens: list[int], sent: str, final: str | None, hold: int) -> str:
        """What to stream next: the decoded text beyond `sent`, keeping back a possible partial stop
        string (hold characters) and an unfinished UTF-8 character until the completion ends."""
        if final is not None:
            return final[len(sent):] if final.startswith(sent) else ""
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        if text.endswith("\ufffd"):
            text = text[:-1]
        text = text[:max(len(sent), len(text) - hold)]
        return text[len(sent):] if text.startswith(sent) else ""

    # --- weights --------------------------------------------------------------------------------
    async def update_weights(self, tensors_of: Callable[[], dict[str, torch.Tensor]], what: str, param: str,
                             weight_version: str | None = None, abort_all: bool = False) -> JSONResponse | dict:
        """Read new weights (tensors_of, off the event loop) and swap them in between engine steps.
        The answer has SGLang's fields (success, message, num_paused_requests: the completions
        aborted) and lockstep's weights_version and weight_version; a failure is a 400 that also has
        an error body naming `param`, and the old weights stay."""
        try:
            tensors = await asyncio.to_thread(tensors_of)
        except (OSError, ValueError) as e:
            return update_refused(str(e) if str(e).startswith(f"{param}:") else f"{param}: {e}", param)
        try:
            update = await asyncio.wrap_future(self.worker.update_weights(tensors, weight_version, abort_all))
        except WeightUpdateError as e:
            return update_refused(f"{param}: {what}: {e}; the old weights stay", param, e.aborted)
        return {"success": True, "message": f"weights from {what}", "num_paused_requests": update.aborted,
                "weights_version": update.version, "weight_version": update.weight_version}

    def model_info(self) -> dict:
        config = self.model.config.to_hf()
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.worker.weight_version,
                "weights_version": self.worker.version, "served_model_name": self.name,
                "model_type": config.get("model_type"), "architectures": config.get("architectures"),
                "max_context_length": self.context}

    def server_info(self) -> dict:
        """What /get_server_info answers: model_info and the SGLang server fields a router reads
        (dp_size, tp_size, context_length, the running and token limits), and lockstep's
        `fingerprint` (lockstep.machine: backend, instruction set or GPU, torch and Triton versions),
        which an RL trainer compares with its own before it samples."""
        from ..machine import fingerprint

        engine = self.worker.engine
        return {**self.model_info(), "dp_size": 1, "tp_size": 1,
                "fingerprint": fingerprint(self.worker.backend, self.model.device),
                "context_length": self.context, "max_running_requests": engine.scheduler.max_num_seqs,
                "max_total_num_tokens": engine.limits.num_blocks * engine.limits.block_size,
                "page_size": engine.limits.block_size}


def get_server(request: Request) -> Server:
    """The app's Server (a FastAPI dependency of every route)."""
    return request.app.state.server
