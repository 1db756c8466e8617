"""`lockstep serve`: an OpenAI-compatible HTTP server over lockstep's Engine (FastAPI).

    GET  /health, /v1/models
    POST /v1/completions, /v1/chat/completions      (stream: server-sent events)
    POST /update_weights_from_disk {"model_path"}   SGLang's weight update: a safetensors folder
    POST /update_weights                            the same, the safetensors file as the body

Every answer carries `weights_version`. Every completion's logprobs are those of the same request
sent alone, whatever else is in flight, and equal `lockstep.logprobs` on its tokens at its
temperature: the engine is batch-invariant. A bad request gets a 4xx with an OpenAI-style error body
that names the field, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine import Engine, RequestOutput
from ..model import Transformer
from ..sampling import Draw, SamplingParams
from .chat import ChatTemplate
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chat_response,
    completion_logprobs,
    completion_response,
    error_body,
    usage,
)
from .worker import EngineWorker, Job


class RequestError(Exception):
    """A request the server refuses: an HTTP status, the offending field and why."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class Server:
    """The model, its engine thread, and what the HTTP handlers need to turn requests into jobs."""

    def __init__(self, model: Transformer, name: str, engine_kwargs: dict, model_dir: str | None = None,
                 api_key: str | None = None, load_weights: Callable[[str], dict[str, torch.Tensor]] | None = None,
                 backend: str = "auto"):
        self.model, self.name, self.api_key = model, name, api_key
        self.tokenizer = model.tokenizer
        self.chat_template = ChatTemplate.for_tokenizer(self.tokenizer, model_dir)
        self.context = model.config.max_position_embeddings
        self.worker = EngineWorker(Engine(model, **engine_kwargs), backend=backend)
        self.load_weights = load_weights

    # --- prompts and sampling -------------------------------------------------------------------
    def text_of(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"<{token}>"

    def encode(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(400, f"{param}: this model has no tokenizer; send token ids", param)
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError(400, f"{param}: expected at least one token", param)
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(400, f"{param}: token ids must be in [0, {vocab}), got {bad[:5]}", param)
        return ids

    def sampling(self, req, max_tokens: int | None, logprobs: int, prompts: list[list[int]]) -> SamplingParams:
        longest = max(len(p) for p in prompts)
        if longest >= self.context:
            raise RequestError(400, f"prompt: {longest} tokens, the model's context is {self.context}", "prompt")
        room = self.context - longest
        max_tokens = room if max_tokens is None else max_tokens
        if max_tokens > room:
            raise RequestError(400, f"max_tokens: {max_tokens} new tokens after a {longest}-token prompt exceed the "
                                    f"model's context of {self.context} (at most {room})", "max_tokens")
        if req.stop and self.tokenizer is None:
            raise RequestError(400, "stop: stop strings need a model with a tokenizer; use stop_token_ids", "stop")
        params = req.sampling(max_tokens, logprobs)
        eos = self.model.config.eos_token_id
        if not req.ignore_eos and eos is not None:
            params.stop_token_ids += [t for t in (eos if isinstance(eos, list) else [eos]) if t not in params.stop_token_ids]
        if req.seed is None:
            params.seed = secrets.randbelow(2 ** 31)
        try:
            params.validate(self.model.config.vocab_size)
        except ValueError as e:
            field = str(e).split(":", 1)[0]
            raise RequestError(400, str(e), field) from None
        need = -(-(longest + max_tokens) // self.worker.engine.block_size)
        if need > self.worker.engine.blocks.num_blocks:
            raise RequestError(400, f"max_tokens: the request needs {need} KV-cache blocks, the server has "
                                    f"{self.worker.engine.blocks.num_blocks}", "max_tokens")
        return params

    # --- jobs -----------------------------------------------------------------------------------
    def start(self, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
              ) -> tuple[Job, asyncio.Queue]:
        """Submit one prompt; its events arrive on the returned queue: ("token", index, draw) for each
        token, then ("done", outputs, version) or ("error", message)."""
        events: asyncio.Queue = asyncio.Queue()

        def put(*event):
            loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(prompt, params, on_token=lambda out, draw: put("token", out.index, draw),
                  on_done=lambda outs, version: put("done", outs, version), on_error=lambda msg: put("error", msg))
        self.worker.submit(job)
        return job, events


def _decode_delta(server: Server, tokens: list[int], sent: str, final: str | None, hold: int) -> str:
    """What to stream next: the decoded text beyond `sent`, keeping back a possible partial stop string
    (hold characters) and an unfinished UTF-8 character until the completion ends."""
    if final is not None:
        return final[len(sent):] if final.startswith(sent) else ""
    text = server.tokenizer.decode(tokens) if server.tokenizer is not None else ""
    if text.endswith("\ufffd"):
        text = text[:-1]
    text = text[:max(len(sent), len(text) - hold)]
    return text[len(sent):] if text.startswith(sent) else ""


def create_app(server: Server):
    """The FastAPI application of `server` (its engine thread starts with the app)."""
    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        yield
        server.worker.stop()

    app = FastAPI(title="lockstep", lifespan=lifespan)

    def fail(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        return JSONResponse(error_body(message, param, kind), status_code=status)

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return fail(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return fail(400, f"body: malformed JSON ({err.get('msg')})", "body")
        param = ".".join(loc) or "body"
        if err.get("type") == "extra_forbidden":
            return fail(400, f"{param}: unknown field", param)
        return fail(400, f"{param}: {err.get('msg')}", param)

    @app.middleware("http")
    async def _api_key(request: Request, call_next):
        if server.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                return fail(401, "authorization: expected 'Bearer <api key>'", "authorization",
                            "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health():
        blocks = server.worker.engine.blocks
        return {"status": "ok", "weights_version": server.worker.version, "in_flight": server.worker.in_flight,
                "free_kv_blocks": blocks.num_free, "kv_blocks": blocks.num_blocks}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "lockstep", "max_model_len": server.context,
                                            "weights_version": server.worker.version}]}

    async def collect(request: Request, jobs: list[tuple[Job, asyncio.Queue]]) -> tuple[list[list[RequestOutput]], int]:
        """Wait for every job; abort them all if the client goes away."""
        results, versions = [], []
        try:
            for job, events in jobs:
                while True:
                    try:
                        event = await asyncio.wait_for(events.get(), timeout=1.0)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            raise asyncio.CancelledError
                        continue
                    if event[0] == "done":
                        results.append(event[1])
                        versions.append(event[2])
                        break
                    if event[0] == "error":
                        raise RequestError(500, f"engine: {event[1]}")
        except BaseException:
            for job, _ in jobs:
                server.worker.abort(job)
            raise
        return results, max(versions)

    async def stream(jobs: list[tuple[Job, asyncio.Queue]], prompts: list[list[int]], n: int, chunk: Callable,
                     include_usage: bool, hold: int) -> AsyncIterator[str]:
        """Server-sent events: a chunk per token (text, logprobs), then each choice's finish, usage, [DONE]."""
        finished: list[RequestOutput] = []
        version = 0
        try:
            for p, (job, events) in enumerate(jobs):
                tokens = {i: [] for i in range(n)}
                sent = {i: "" for i in range(n)}
                while True:
                    event = await events.get()
                    if event[0] == "token":
                        _, i, draw = event
                        tokens[i].append(draw.token)
                        delta = _decode_delta(server, tokens[i], sent[i], None, hold)
                        sent[i] += delta
                        yield chunk(p * n + i, delta, draw, len(tokens[i]) - 1, None)
                    elif event[0] == "done":
                        _, outs, version = event
                        for out in outs:
                            delta = _decode_delta(server, out.token_ids, sent[out.index], out.text or "", hold)
                            yield chunk(p * n + out.index, delta, None, None, out.finish_reason)
                        finished.extend(outs)
                        break
                    else:
                        yield f"data: {json.dumps(error_body(event[1], None, 'server_error'))}\n\n"
                        return
            if include_usage:
                yield f"data: {json.dumps({'usage': usage([len(p) for p in prompts], finished), 'choices': [], 'weights_version': version})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for job, _ in jobs:
                server.worker.abort(job)           # a no-op once done; a client gone mid-stream frees its blocks

    def streamed(jobs: list[tuple[Job, asyncio.Queue]], prompts: list[list[int]], params: SamplingParams, body,
                 kind: str, cid: str, choice_of: Callable, logprobs_format: Callable | None) -> StreamingResponse:
        """`stream` as a response of `kind` chunks: choice_of(index, text, finish) gives a chunk's
        choice; a token's logprobs (in `logprobs_format`, when asked) and id are added here."""
        created = int(time.time())

        def chunk(index, text, draw: Draw | None, at, finish):
            choice = {**choice_of(index, text, finish), "logprobs": None}
            if logprobs_format is not None and draw is not None:
                out = RequestOutput(0, [], token_ids=[draw.token], logprobs=[draw.logprob],
                                    top_logprobs=[draw.top] if draw.top else [])
                choice["logprobs"] = logprobs_format(out, server.text_of)
            if body.return_token_ids and draw is not None:
                choice["token_ids"] = [draw.token]
            return "data: " + json.dumps({"id": cid, "object": kind, "created": created, "model": server.name,
                                          "choices": [choice], "weights_version": server.worker.version}) + "\n\n"

        hold = max((len(s) for s in params.stop), default=1) - 1
        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(jobs, prompts, params.n, chunk, include, hold), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = [server.encode(p, "prompt") for p in body.prompts()]
        params = server.sampling(body, body.max_tokens, body.logprobs or 0, prompts)
        loop = asyncio.get_running_loop()
        jobs = [server.start(p, params, loop) for p in prompts]
        want_logprobs = body.logprobs is not None
        if body.stream:
            return streamed(jobs, prompts, params, body, "text_completion", f"cmpl-{secrets.token_hex(12)}",
                            lambda index, text, finish: {"index": index, "text": text, "finish_reason": finish},
                            completion_logprobs if want_logprobs else None)
        groups, version = await collect(request, jobs)
        return completion_response(server.name, prompts, groups, server.text_of, want_logprobs, body.return_token_ids,
                                   version)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        if server.chat_template is None:
            raise RequestError(400, "messages: this model has no chat template (tokenizer_config.json); use "
                                    "/v1/completions", "messages")
        text = server.chat_template.render([m.model_dump(exclude_none=True) for m in body.messages],
                                           body.add_generation_prompt)
        prompt = server.tokenizer.encode(text, add_bos=False)
        prompt = server.encode(prompt, "messages")
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise RequestError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        params = server.sampling(body, body.budget(), top, [prompt])
        jobs = [server.start(prompt, params, asyncio.get_running_loop())]
        if body.stream:
            started: set[int] = set()

            def choice_of(index, text, finish):
                delta = {"content": text}
                if index not in started:
                    started.add(index)
                    delta["role"] = "assistant"
                return {"index": index, "delta": delta, "finish_reason": finish}

            return streamed(jobs, [prompt], params, body, "chat.completion.chunk", f"chatcmpl-{secrets.token_hex(12)}",
                            choice_of, chat_logprobs if body.logprobs else None)
        groups, version = await collect(request, jobs)
        return chat_response(server.name, prompt, groups[0], server.text_of, body.logprobs, body.return_token_ids,
                             version)

    async def update(tensors_of: Callable[[], dict[str, torch.Tensor]], what: str):
        try:
            tensors = await asyncio.to_thread(tensors_of)
        except (OSError, ValueError) as e:
            return fail(400, str(e), "model_path")
        future = server.worker.update_weights(tensors)
        try:
            version = await asyncio.wrap_future(future)
        except (ValueError, RuntimeError) as e:
            return fail(400, f"{what}: {e}; the old weights stay", "model_path")
        return {"success": True, "message": f"weights from {what}", "weights_version": version}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return fail(400, "body: malformed JSON", "body")
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return fail(400, "model_path: expected a string, the path of a checkpoint folder", "model_path")
        unknown = sorted(set(body) - {"model_path", "load_format", "flush_cache", "abort_all_requests"})
        if unknown:
            return fail(400, f"{unknown[0]}: unknown field", unknown[0])
        if server.load_weights is None:
            return fail(400, "model_path: this server cannot load weights from disk", "model_path")
        path = body["model_path"]
        return await update(lambda: server.load_weights(path), path)

    @app.post("/update_weights")
    async def update_weights(request: Request):
        from safetensors.torch import load as load_safetensors

        raw = await request.body()

        def parse():
            try:
                return load_safetensors(raw)
            except Exception as e:
                raise ValueError(f"body: not a safetensors file ({str(e).splitlines()[0] if str(e) else e})") from None
        return await update(parse, "the request body")

    return app
