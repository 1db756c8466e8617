"""`lockstep serve`: lockstep's Engine behind OpenAI's API and SGLang's native one (FastAPI).

    GET  /health                                    status, weights_version, weight_version, in flight, KV blocks
    OpenAI (openai_api.py):
    GET  /v1/models
    POST /v1/completions, /v1/chat/completions      (stream: server-sent events)
    SGLang (sglang_api.py, shapes in sglang_protocol.py):
    POST /generate                                  text or input_ids, one or a batch; sampling_params, return_logprob,
                                                    logprob_start_len, top_logprobs_num, stream, rid
    POST /update_weights_from_disk                  {model_path, weight_version, abort_all_requests, flush_cache}
                                                    -> {success, message, num_paused_requests}
    POST /update_weights                            lockstep's: the same, a safetensors file as the body
    POST /flush_cache, GET /get_model_info

The routes are module-level functions on APIRouters; the one piece of state, the `Server` (model,
engine thread, request checks), is `app.state.server`, which every route gets through
`Depends(get_server)`.

Weights have two names, recorded on every job when it is admitted: `weights_version`, the int
count of updates (OpenAI answers), and `weight_version`, the label the last update gave, else
str(weights_version) (SGLang's meta_info.weight_version). Every completion's logprobs are those of
the same request sent alone, whatever else is in flight, and equal `lockstep.logprobs` on its
tokens at its temperature: the engine is batch-invariant. A bad request gets a 4xx whose body names
the field (OpenAI's error shape, `param`): requests are checked by the engine's own check
(lockstep.engine.requests) before they are queued. The server keeps serving.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError

from . import openai_api, sglang_api
from .state import RequestError, Server, describe_validation_error, fail, get_server

__all__ = ["Server", "RequestError", "create_app"]

router = APIRouter()


@router.get("/health")
async def health(server: Server = Depends(get_server)):
    blocks = server.worker.engine.blocks
    return {"status": "ok", "weights_version": server.worker.version, "weight_version": server.worker.weight_version,
            "in_flight": server.worker.in_flight, "free_kv_blocks": blocks.num_free, "kv_blocks": blocks.num_blocks}


async def _request_error(request: Request, e: RequestError):
    return fail(e.status, e.message, e.param)


async def _validation_error(request: Request, e: RequestValidationError):
    err = e.errors()[0]
    if err.get("type") == "json_invalid":
        return fail(400, f"body: malformed JSON ({err.get('msg')})", "body")
    param, message = describe_validation_error(err)
    return fail(400, message, param)


async def _api_key(request: Request, call_next):
    key = request.app.state.server.api_key
    if key and request.url.path != "/health":
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return fail(401, "authorization: expected 'Bearer <api key>'", "authorization", "authentication_error")
    return await call_next(request)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    worker = app.state.server.worker               # the engine thread runs while the app does
    worker.start()
    yield
    worker.stop()


def create_app(server: Server) -> FastAPI:
    """The FastAPI application of `server` (its engine thread starts with the app)."""
    app = FastAPI(title="lockstep", lifespan=_lifespan)
    app.state.server = server
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.middleware("http")(_api_key)
    for r in (router, openai_api.router, sglang_api.router):
        app.include_router(r)
    return app
