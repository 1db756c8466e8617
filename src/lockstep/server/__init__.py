"""`lockstep serve`: lockstep's Engine behind OpenAI's HTTP API and SGLang's native one, with weight
updates (FastAPI, uvicorn).

    app.py              the application: the route list, errors, the API key, /health
    state.py            the Server (app.state.server): requests to jobs, the request check, weight updates
    openai_api.py       /v1/models, /v1/completions, /v1/chat/completions
    sglang_api.py       /generate, /update_weights_from_disk, /update_weights, /flush_cache, /get_model_info,
                        /get_server_info (and /model_info, /server_info, which SGLang's router asks first)
    worker.py           the engine's own thread, and weight updates that never mix two versions
    protocol.py         OpenAI's request bodies (unknown fields refused) and answers
    sglang_protocol.py  SGLang's request bodies and answers
    compat.py           fields SGLang's clients and router send, accepted at the values that change nothing
"""

from __future__ import annotations

import os

import torch

from ..model import Transformer, gguf, load_model, model_from_source, with_byte_tokenizer
from .app import Server, create_app

__all__ = ["Server", "create_app", "build_server", "serve", "weights_from_disk", "weights_from_folder"]


def weights_from_disk(path: str, model: Transformer) -> dict[str, torch.Tensor]:
    """The parameters of the checkpoint at `path`, read by the loader that `lockstep serve` starts
    from (a Hugging Face folder, a GGUF file or a folder holding one), refused unless it is `model`'s
    architecture."""
    if not isinstance(path, str) or not (os.path.isdir(path) or os.path.isfile(path)):
        raise FileNotFoundError(f"model_path: {path!r} is not a folder or a .gguf file")
    if os.path.isfile(path) and gguf.find_gguf(path) is None:
        raise ValueError(f"model_path: {path!r} is not a folder or a .gguf file")
    new = load_model(path, dtype=model.dtype, device=model.device)
    if new.config.to_hf() != model.config.to_hf():
        theirs, ours = new.config.to_hf(), model.config.to_hf()
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise ValueError(f"model_path: {path} holds another architecture (differs in {diff[:5]})")
    return {n: p.detach() for n, p in new.named_parameters()}


weights_from_folder = weights_from_disk            # its former name, which callers import


def build_server(source: str, dtype: torch.dtype = torch.float32, family: str = "llama", seed: int = 0,
                 name: str | None = None, api_key: str | None = None, backend: str = "auto",
                 **engine_kwargs) -> Server:
    """A Server for `source` ("tiny", "smollm2", a checkpoint folder or a GGUF file) computing on `backend` ("eager" shows
    what stock PyTorch would serve); engine_kwargs go to Engine."""
    model = with_byte_tokenizer(model_from_source(source, dtype, family, seed))
    return Server(model, name or (os.path.basename(os.path.abspath(source)) if source != "tiny" else f"tiny-{family}"),
                  engine_kwargs, model_dir=source if os.path.isdir(source) else None, api_key=api_key,
                  load_weights=lambda path: weights_from_disk(path, model), backend=backend, model_path=source)


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.run(create_app(server), host=host, port=port, log_level=log_level)
