"""The backend registry: one place that decides which implementation of an op runs.

Callers use `lockstep.ops.*` and never name a backend. A backend registers one callable per op
(`register`); `use_backend(name)` selects one for a block of code (per thread), and the default,
"auto", picks "triton" for CUDA tensors when that backend is registered and "portable" otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

OPS = (
    "embedding",
    "rms_norm",
    "linear",
    "rope",
    "silu_mul",
    "log_softmax",
    "selected_logprobs",
    "cross_entropy",
    "attention",
    "paged_attention",
)

_REGISTRY: dict[str, dict[str, Callable]] = {}
_LOADERS: dict[str, Callable[[], None]] = {}
_state = threading.local()
# Active op recorders (lockstep.parity.Recorder); when one is active, every op call goes through it.
RECORDERS: list = []


def register(backend: str, op: str) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as `backend`'s implementation of `op`."""
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; expected one of {sorted(OPS)}")

    def wrap(fn: Callable) -> Callable:
        _REGISTRY.setdefault(backend, {})[op] = fn
        return fn

    return wrap


_FALLBACK: dict[str, str] = {}


def set_fallback(backend: str, fallback: str) -> None:
    """Ops that `backend` does not implement run on `fallback` (a backend that overrides a few ops)."""
    _FALLBACK[backend] = fallback


def register_loader(backend: str, loader: Callable[[], None]) -> None:
    """Register a function that imports a backend's modules on first use (keeps imports light)."""
    _LOADERS[backend] = loader


def _load(backend: str) -> None:
    loader = _LOADERS.pop(backend, None)
    if loader is not None:
        loader()


def available_backends() -> list[str]:
    """Names accepted by `use_backend`, "auto" included."""
    return ["auto"] + sorted(set(_REGISTRY) | set(_LOADERS))


def current_backend() -> str:
    """The backend name selected for this thread ("auto" unless `use_backend` is active)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else "auto"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Run the ops inside the block with backend `name` ("auto", "portable", "eager", "triton", ...)."""
    if not isinstance(name, str) or name not in available_backends():
        raise ValueError(f"backend: unknown backend {name!r}; expected one of {available_backends()}")
    _load(name)
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(name)
    try:
        yield name
    finally:
        stack.pop()


def resolve(op: str, device: torch.device) -> Callable:
    """The implementation of `op` for tensors on `device` under the current selection."""
    name = current_backend()
    if name == "auto":
        name = "portable"
        if device.type == "cuda":
            _load("triton")
            if op in _REGISTRY.get("triton", {}):
                name = "triton"
    _load(name)
    impl = _REGISTRY.get(name, {}).get(op)
    while impl is None and name in _FALLBACK:
        name = _FALLBACK[name]
        _load(name)
        impl = _REGISTRY.get(name, {}).get(op)
    if impl is None:
        raise NotImplementedError(f"backend {name!r} has no implementation of {op!r}")
    if RECORDERS:
        return RECORDERS[-1].wrap(op, impl)
    return impl
