"""SGLang's native API (the rollout API of RL frameworks): POST /generate, the weight updates, POST
/flush_cache, GET /get_model_info and /get_server_info (also as /model_info and /server_info, the
names SGLang's router asks first when it registers a worker). Request and answer shapes:
sglang_protocol.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from . import compat
from .protocol import error_body
from .sglang_protocol import GenerateRequest, Item, UpdateWeightsFromDiskRequest, finish_reason, items, output
from .state import Server, fail, get_server, update_refused
from .worker import Job

router = APIRouter()


def _start(server: Server, todo: list[Item], events: asyncio.Queue) -> list[Job]:
    """Submit every prompt (tag k: the k-th), the prompt's logprobs computed when asked for."""
    loop = asyncio.get_running_loop()
    jobs = []
    for k, item in enumerate(todo):
        start = item.logprob_start_len if item.return_logprob and item.logprob_start_len >= 0 else None
        jobs.append(server.start(item.prompt, item.params, loop, events, tag=k, prompt_logprobs_from=start,
                                 prompt_top_logprobs=item.top_logprobs_num)[0])
    return jobs


def _text_of(server: Server, body: GenerateRequest):
    return server.text_of if body.return_text_in_logprobs else None


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, server: Server = Depends(get_server)):
    todo, single = items(body, server)
    started = time.time()
    events: asyncio.Queue = asyncio.Queue()
    jobs = _start(server, todo, events)
    text_of = _text_of(server, body)
    if body.stream:
        return StreamingResponse(_stream(server, todo, jobs, events, single, text_of, started),
                                 media_type="text/event-stream")
    done = await server.collect(request, jobs, events)
    answers = []
    for k, (item, job) in enumerate(zip(todo, jobs)):
        for out in done[k][0]:
            answers.append(output(item, out.index, out.token_ids, out.logprobs, out.top_logprobs, out.text or "",
                                  finish_reason(out, item.params), out.cached_tokens, job.weight_version,
                                  job.prompt_logprobs, job.prompt_top, text_of, time.time() - started))
    return answers[0] if single else answers


async def _stream(server: Server, todo: list[Item], jobs: list[Job], events: asyncio.Queue, single: bool, text_of,
                  started: float) -> AsyncIterator[str]:
    """SGLang's stream: a `data: {...}` event per token of each completion, holding the whole
    completion so far (text, output_ids, meta_info with finish_reason None), then its last one with
    the finish_reason; completions interleave, each event of a batch with its `index`; then
    `data: [DONE]`. A client that goes away aborts the request."""
    first = [sum(item.params.n for item in todo[:k]) for k in range(len(todo))]
    hold = [max((len(s) for s in item.params.stop), default=1) - 1 for item in todo]
    so_far: dict[tuple[int, int], dict] = {}

    def event(k: int, i: int, answer: dict) -> str:
        if not single:
            answer["index"] = first[k] + i
        return f"data: {json.dumps(answer)}\n\n"

    finished = 0
    try:
        while finished < len(jobs):
            e = await events.get()
            k, job, item = e[1], jobs[e[1]], todo[e[1]]
            if e[0] == "token":
                _, _, i, draw, cached = e
                s = so_far.setdefault((k, i), {"tokens": [], "logprobs": [], "tops": [], "text": ""})
                s["tokens"].append(draw.token)
                s["logprobs"].append(draw.logprob)
                s["tops"].append(draw.top)
                s["text"] += server.decode_delta(s["tokens"], s["text"], None, hold[k])
                yield event(k, i, output(item, i, s["tokens"], s["logprobs"], s["tops"], s["text"], None, cached,
                                         job.weight_version, job.prompt_logprobs, job.prompt_top, text_of))
            elif e[0] == "done":
                for out in e[2]:
                    yield event(k, out.index, output(item, out.index, out.token_ids, out.logprobs, out.top_logprobs,
                                                     out.text or "", finish_reason(out, item.params), out.cached_tokens,
                                                     job.weight_version, job.prompt_logprobs, job.prompt_top, text_of,
                                                     time.time() - started))
                finished += 1
            else:
                yield f"data: {json.dumps(error_body(f'engine: {e[2]}', None, 'server_error'))}\n\n"
                return
        yield "data: [DONE]\n\n"
    finally:
        server.abort(jobs)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, server: Server = Depends(get_server)):
    """SGLang's weight update from disk, read as the server read its model at start (a checkpoint
    folder, a GGUF file or a folder holding one): requests in flight finish on the old weights,
    or with abort_all_requests end now (finish_reason abort; num_paused_requests counts them); later
    answers carry `weight_version` (meta_info.weight_version) and the int `weights_version`."""
    if server.load_weights is None:
        return update_refused("model_path: this server cannot load weights from disk", "model_path")
    found = compat.unsupported(body, compat.UPDATE_FROM_DISK)
    if found is not None:
        return update_refused(found[1], found[0])
    path = body.model_path
    mismatch = compat.load_format_mismatch(body.load_format, path)
    if mismatch is not None:
        return update_refused(mismatch, "load_format")
    answer = await server.update_weights(lambda: server.load_weights(path), path, "model_path", body.weight_version,
                                         body.abort_all_requests)
    if isinstance(answer, dict):
        server.model_path = path
    return answer


@router.post("/update_weights")
async def update_weights(request: Request, weight_version: str | None = None, abort_all_requests: bool = False,
                         server: Server = Depends(get_server)):
    """lockstep's: the same update, the safetensors file as the body (weight_version and
    abort_all_requests as query parameters)."""
    from safetensors.torch import load as load_safetensors

    raw = await request.body()

    def parse():
        try:
            return load_safetensors(raw)
        except Exception as e:
            raise ValueError(f"body: not a safetensors file ({str(e).splitlines()[0] if str(e) else e})") from None
    return await server.update_weights(parse, "the request body", "body", weight_version, abort_all_requests)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(server: Server = Depends(get_server)):
    """Forget the prefix cache; as in SGLang, only while no request is in flight (else a 400)."""
    if await asyncio.wrap_future(server.worker.flush_cache()):
        return {"success": True, "message": "Cache flushed."}
    return fail(400, "flush_cache: requests are in flight or waiting; the cache was not flushed", "flush_cache")


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(server: Server = Depends(get_server)) -> dict:
    """The model served: SGLang's fields (model_path, tokenizer_path, is_generation, weight_version, ...)."""
    return server.model_info()


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(server: Server = Depends(get_server)) -> dict:
    """The server: the model's fields and SGLang's server fields that describe this one (one engine,
    no data or tensor parallelism, its context and KV cache)."""
    return server.server_info()
