"""OpenAI's API: GET /v1/models, POST /v1/completions and POST /v1/chat/completions (stream:
server-sent events). Answers carry `weights_version`, the int count of weight updates."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ..engine import RequestOutput
from ..sampling import Draw, SamplingParams
from . import compat
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
from .state import RequestError, Server, get_server, refuse_unsupported
from .worker import Job

router = APIRouter()


def _sampling(server: Server, req, max_tokens: int | None, logprobs: int, prompts: list[list[int]],
              names: dict[str, str]) -> SamplingParams:
    """The request's SamplingParams (max_tokens by default: what the context leaves), checked by the
    engine's own check for every prompt."""
    max_tokens = server.room(prompts) if max_tokens is None else max_tokens
    params = server.finish_sampling(req.sampling(max_tokens, logprobs), req.ignore_eos, req.seed is not None)
    for prompt in prompts:
        server.check(prompt, params, names)
    return params


@router.get("/v1/models")
async def models(server: Server = Depends(get_server)):
    return {"object": "list", "data": [{"id": server.name, "object": "model", "created": int(time.time()),
                                        "owned_by": "lockstep", "max_model_len": server.context,
                                        "weights_version": server.worker.version}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, server: Server = Depends(get_server)):
    refuse_unsupported(body, compat.COMPLETIONS)
    prompts = [server.encode(p, "prompt") for p in body.prompts()]
    params = _sampling(server, body, body.max_tokens, body.logprobs or 0, prompts, {"max_new_tokens": "max_tokens"})
    want_logprobs = body.logprobs is not None
    if body.stream:
        loop = asyncio.get_running_loop()
        jobs = [server.start(p, params, loop, tag=k) for k, p in enumerate(prompts)]
        return _streamed(server, jobs, prompts, params, body, "text_completion", f"cmpl-{secrets.token_hex(12)}",
                         lambda index, text, finish: {"index": index, "text": text, "finish_reason": finish},
                         completion_logprobs if want_logprobs else None)
    groups, version = await _collect(server, request, prompts, params)
    return completion_response(server.name, prompts, groups, server.text_of, want_logprobs, body.return_token_ids,
                               version)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, server: Server = Depends(get_server)):
    refuse_unsupported(body, compat.CHAT)
    if server.chat_template is None:
        raise RequestError(400, "messages: this model has no chat template (tokenizer_config.json); use "
                                "/v1/completions", "messages")
    try:
        text = server.chat_template.render([m.model_dump(exclude_none=True) for m in body.messages],
                                           body.add_generation_prompt)
    except ValueError as e:                       # the template refused these messages
        message = str(e) if str(e).startswith("messages:") else f"messages: {e}"
        raise RequestError(400, message, "messages") from None
    prompt = server.encode(server.tokenizer.encode(text, add_bos=False), "messages")
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise RequestError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
    budget = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    params = _sampling(server, body, body.budget(), top, [prompt],
                       {"prompt": "messages", "max_new_tokens": budget, "logprobs": "top_logprobs"})
    if body.stream:
        started: set[int] = set()

        def choice_of(index, text, finish):
            delta = {"content": text}
            if index not in started:
                started.add(index)
                delta["role"] = "assistant"
            return {"index": index, "delta": delta, "finish_reason": finish}

        jobs = [server.start(prompt, params, asyncio.get_running_loop())]
        return _streamed(server, jobs, [prompt], params, body, "chat.completion.chunk",
                         f"chatcmpl-{secrets.token_hex(12)}", choice_of, chat_logprobs if body.logprobs else None)
    groups, version = await _collect(server, request, [prompt], params)
    return chat_response(server.name, prompt, groups[0], server.text_of, body.logprobs, body.return_token_ids,
                         version)


async def _collect(server: Server, request: Request, prompts: list[list[int]], params: SamplingParams
                   ) -> tuple[list[list[RequestOutput]], int]:
    """Run every prompt to its end: each prompt's completions, in prompt order, and the newest version."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    jobs = [server.start(p, params, loop, events, tag=k)[0] for k, p in enumerate(prompts)]
    done = await server.collect(request, jobs, events)
    return [done[k][0] for k in range(len(prompts))], max(version for _, version in done.values())


async def _stream(server: Server, jobs: list[tuple[Job, asyncio.Queue]], prompts: list[list[int]], n: int,
                  chunk: Callable, include_usage: bool, hold: int) -> AsyncIterator[str]:
    """Server-sent events, prompt by prompt: a chunk per token (text, logprobs), then each choice's
    finish, usage, [DONE]."""
    finished: list[RequestOutput] = []
    version = 0
    try:
        for p, (job, events) in enumerate(jobs):
            tokens = {i: [] for i in range(n)}
            sent = {i: "" for i in range(n)}
            while True:
                event = await events.get()
                if event[0] == "token":
                    _, _, i, draw, _ = event
                    tokens[i].append(draw.token)
                    delta = server.decode_delta(tokens[i], sent[i], None, hold)
                    sent[i] += delta
                    yield chunk(p * n + i, delta, draw, None, job.version)
                elif event[0] == "done":
                    _, _, outs, version = event
                    for out in outs:
                        delta = server.decode_delta(out.token_ids, sent[out.index], out.text or "", hold)
                        yield chunk(p * n + out.index, delta, None, out.finish_reason, version)
                    finished.extend(outs)
                    break
                else:
                    yield f"data: {json.dumps(error_body(event[2], None, 'server_error'))}\n\n"
                    return
        if include_usage:
            body = {"usage": usage([len(p) for p in prompts], finished), "choices": [], "weights_version": version}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        server.abort([job for job, _ in jobs])


def _streamed(server: Server, jobs: list[tuple[Job, asyncio.Queue]], prompts: list[list[int]],
              params: SamplingParams, body, kind: str, cid: str, choice_of: Callable,
              logprobs_format: Callable | None) -> StreamingResponse:
    """`_stream` as a response of `kind` chunks: choice_of(index, text, finish) gives a chunk's choice;
    a token's logprobs (in `logprobs_format`, when asked) and id, and the version of the weights that
    drew it, are added here."""
    created = int(time.time())

    def chunk(index, text, draw: Draw | None, finish, version: int):
        choice = {**choice_of(index, text, finish), "logprobs": None}
        if logprobs_format is not None and draw is not None:
            out = RequestOutput(0, [], token_ids=[draw.token], logprobs=[draw.logprob],
                                top_logprobs=[draw.top] if draw.top else [])
            choice["logprobs"] = logprobs_format(out, server.text_of)
        if body.return_token_ids and draw is not None:
            choice["token_ids"] = [draw.token]
        return "data: " + json.dumps({"id": cid, "object": kind, "created": created, "model": server.name,
                                      "choices": [choice], "weights_version": version}) + "\n\n"

    hold = max((len(s) for s in params.stop), default=1) - 1
    include = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_stream(server, jobs, prompts, params.n, chunk, include, hold),
                             media_type="text/event-stream")
