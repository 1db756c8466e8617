"""`lockstep serve`: lockstep's Engine behind OpenAI's API and SGLang's native one (FastAPI).

    GET  /health                                    status, weights_version, weight_version, in flight, KV blocks
    OpenAI (openai_api.py):
    GET  /v1/models
    POST /v1/completions, /v1/chat/completions      (stream: server-sent events)
    SGLang (sglang_api.py, shapes in sglang_protocol.py):
    POST /generate                                  text or input_ids, one or a batch; sampling_params, return_logprob,
                                                    logprob_start_len, top_logprobs_num, stream, rid
    POST /update_weights_from_disk                  {model_path (a folder or a GGUF file), weight_version,
                                                    abort_all_requests, flush_cache}
                                                    -> {success, message, num_paused_requests}
    POST /update_weights                            lockstep's: the same, a safetensors file as the body
    POST /flush_cache, GET /get_model_info, GET /get_server_info (also /model_info, /server_info)

The routes are module-level functions on APIRouters; the one piece of state, the `Server` (model,
engine thread, request checks), is `app.state.server`, which every route gets through
`Depends(get_server)`.

Weights have two names, recorded on every job when it is admitted: `weights_version`, the int
count of updates (OpenAI answers), and `weight_version`, the label the last update gave, else
str(weights_version) (SGLang's meta_info.weight_version). Every completion's logprobs are those of
the same request sent alone, whatever else is in flight, and equal `lockstep.logprobs` on its
tokens at its temperature: the engine is batch-invariant. A bad request gets a 4xx whose body names
the field (OpenAI's error shape, `param`): requests are checked by the engine's own check
(lockstep.engine.requests) before they are queued. The fields SGLang's clients and router add are
accepted at the values that change nothing (compat.py). The server keeps serving.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from . import openai_api, sglang_api
from .state import RequestError, Server, describe_validation_error, fail, get_server

__all__ = ["Server", "RequestError", "create_app"]

router = APIRouter()


@router.get("/health")
async def health(server: Server = Depends(get_server)):
    blocks = server.worker.engine.blocks
    if not server.worker.alive:                    # every request would wait forever: not healthy
        return JSONResponse({"status": "error", "message": "the engine thread stopped; see the server log"},
                            status_code=503)
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


class _ApiKey:
    """Refuses requests without 'Authorization: Bearer <key>' (but /health). A plain ASGI
    middleware: Starlette's BaseHTTPMiddleware would hide a client's disconnect from the routes,
    which then could not abort the work of a client that went away."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.key}".encode()):
                response = fail(401, "authorization: expected 'Bearer <api key>'", "authorization",
                                "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    if server.api_key:
        app.add_middleware(_ApiKey, key=server.api_key)
    for r in (router, openai_api.router, sglang_api.router):
        app.include_router(r)
    return app
