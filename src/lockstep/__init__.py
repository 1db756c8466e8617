"""lockstep: the same bits when an LLM serves and when it trains.

`import lockstep` loads the public ops and the backend registry, nothing more: a backend's kernels
load the first time an op runs on it, and the model, engine, trainer and batch-invariant mode load
the first time one of their names is used.
"""

from . import ops
from .registry import available_backends, current_backend, use_backend

# Public name -> the module that defines it, imported on first use.
_LAZY = {
    "load_model": "model", "logprobs": "model", "Transformer": "model", "ModelConfig": "model",
    "Engine": "engine", "RequestOutput": "engine",
    "SamplingParams": "sampling",
    "batch_invariant": "mode", "enable": "mode", "disable": "mode",
    "patch": "hf", "unpatch": "hf",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = ["ops", "use_backend", "current_backend", "available_backends", *_LAZY, "__version__"]
