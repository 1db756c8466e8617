"""The backend registry: one place that decides which implementation of an op runs.

Callers use `lockstep.ops.*` and never name a backend. A backend is a package with one module per
op it implements, named for the op (`op_module`), each registering its implementation (`register`).
The first time a backend is used, its package is imported and then every op module it holds
(`import_op_modules`): `import lockstep` imports no kernel, and OPS is the one list of ops.
`use_backend(name)` selects a backend for a block of code (per thread); the default, "auto", picks
"triton" for CUDA tensors and, on a CPU, "native" where its kernels build, else "portable" (saying
once why).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import threading
from types import ModuleType
from typing import Callable, Iterator, NoReturn

import torch

from .numerics.cpu_kernels import CpuKernels, removed_selection

# Every op a backend can implement; each has its faces under its own name (docs/architecture.md).
OPS = (
    "embedding",
    "rms_norm",
    "linear",
    "rope",
    "silu_mul",
    "gelu_mul",
    "log_softmax",
    "selected_logprobs",
    "vocab_logprobs",
    "cross_entropy",
    "attention",
    "paged_attention",
    "masked_attention",
)
# Ops that live in another op's module: paged_attention runs attention's kernels on a paged cache.
_MODULE_OF = {"paged_attention": "attention"}

# Backend name -> the package whose import registers its ops.
BACKENDS: dict[str, str] = {
    "native": "lockstep.backends.native",
    "portable": "lockstep.backends.portable",
    "eager": "lockstep.backends.eager",
    "reference": "lockstep.backends.reference",
    "triton": "lockstep.backends.triton",
}

_REGISTRY: dict[str, dict[str, Callable]] = {}
# Ops a backend lacks run on its fallback (Triton implements every op of OPS; a backend registered
# with register_backend may implement a few).
_FALLBACK: dict[str, str] = {"triton": "portable"}
_loaded: set[str] = set()
_state = threading.local()
# Active op recorders (lockstep.parity.Recorder); when one is active, every op call goes through it.
RECORDERS: list = []
# Backend name -> the CPU kernel set it registered (register_kernel_set).
_KERNEL_SETS: dict[str, CpuKernels] = {}


def register(backend: str, op: str) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as `backend`'s implementation of `op`."""
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; expected one of {sorted(OPS)}")

    def wrap(fn: Callable) -> Callable:
        _REGISTRY.setdefault(backend, {})[op] = fn
        _RESOLVED.clear()
        return fn

    return wrap


def register_backend(name: str, module: str | None = None, fallback: str | None = None) -> None:
    """Make `name` a backend: `module` (if given) and its op modules are imported on first use to
    register its ops, and ops it does not implement run on `fallback` (for a backend that overrides a
    few ops)."""
    if module is not None:
        BACKENDS[name] = module
    _REGISTRY.setdefault(name, {})
    if fallback is not None:
        _FALLBACK[name] = fallback
    _RESOLVED.clear()


def op_module(op: str) -> str:
    """The name of the module that holds `op` in every backend's package ("attention" for paged_attention)."""
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; expected one of {sorted(OPS)}")
    return _MODULE_OF.get(op, op)


def import_op_modules(package: str) -> dict[str, ModuleType]:
    """Import each op module that `package` holds (`package`.<op_module(op)> for the ops of OPS), which
    registers its ops: {module name: module}. A module missing is an op the backend does not implement;
    a plain module (not a package) holds no op modules."""
    if not hasattr(importlib.import_module(package), "__path__"):
        return {}
    names = dict.fromkeys(op_module(op) for op in OPS)
    return {name: importlib.import_module(f"{package}.{name}") for name in names
            if importlib.util.find_spec(f"{package}.{name}") is not None}


class BackendUnavailable(ImportError):
    """A backend cannot run on this machine; the message names it and says why."""


def load(backend: str) -> None:
    """Import `backend`'s package and its op modules (once), which registers its ops."""
    if backend in _loaded or backend not in BACKENDS:
        return
    try:
        import_op_modules(BACKENDS[backend])
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == "triton"
        hint = " (pip install 'lockstep[triton]')" if missing else ""
        raise BackendUnavailable(f"backend: {backend!r} cannot be loaded: {e}{hint}") from e
    _loaded.add(backend)
    _RESOLVED.clear()


def _implements(backend: str, op: str) -> bool:
    try:
        return op in registered(backend)
    except ImportError:
        return False


def registered(backend: str) -> dict[str, Callable]:
    """The ops `backend` registered itself (no fallback), loading it first."""
    load(backend)
    return dict(_REGISTRY.get(backend, {}))


def available_backends() -> list[str]:
    """Names accepted by `use_backend`, "auto" included."""
    return ["auto"] + sorted(set(_REGISTRY) | set(BACKENDS))


def current_backend() -> str:
    """The backend name selected for this thread ("auto" unless `use_backend` is active)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else "auto"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Run the ops inside the block with backend `name` ("auto", "portable", "eager", "triton", ...)."""
    if not isinstance(name, str) or name not in available_backends():
        raise ValueError(f"backend: unknown backend {name!r}; expected one of {available_backends()}")
    load(name)
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(name)
    try:
        yield name
    finally:
        stack.pop()


@functools.cache
def cpu_backend() -> str:
    """The backend "auto" runs on CPU tensors: "native" where lockstep's kernels build and load,
    else "portable", after one line on stderr that says why (docs/adr/0010-native-cpu-backend.md)."""
    try:
        load("native")
    except ImportError as e:
        caveat = portable_caveat()
        logging.getLogger("lockstep").warning("lockstep: the native CPU backend is not in use (%s); running the "
                                              "portable backend, whose bits follow this machine's BLAS%s",
                                              e.__cause__ or e, f"; {caveat}" if caveat else "")
        return "portable"
    return "native"


# What the portable backend loses where PyTorch's GEMM breaks one of its premises (fixed_order).
_LOST_WITH = {"row tiles": "batch invariance", "column widths": "tensor-parallel invariance"}


def portable_caveat() -> str:
    """Empty where PyTorch's fp32 CPU GEMM keeps the portable backend's premises at this thread
    count; else a sentence that says which it breaks and what the portable backend loses."""
    from .numerics.fixed_order import torch_gemm_broken_premises

    broken = torch_gemm_broken_premises()
    if not broken:
        return ""
    threads = torch.get_num_threads()
    return (f"PyTorch's fp32 GEMMs here break the {' and '.join(broken)} that the portable backend rests on, so "
            f"it has no {' or '.join(_LOST_WITH[b] for b in broken)} on this machine at {threads} "
            f"thread{'s' if threads != 1 else ''} (docs/contract.md, section 7)")


def register_kernel_set(backend: str, kernels: CpuKernels) -> None:
    """Make `kernels` the CPU kernel set of `backend` (backends/native/cpu.py registers the native
    one), which `cpu_backend_kernel_set` gives where `backend` is the CPU backend."""
    _KERNEL_SETS[backend] = kernels


def cpu_backend_kernel_set() -> CpuKernels | None:
    """The CPU kernels for the arithmetic around the ops (the MoE router's exp, sampling's, AdamW's
    square root, the batch-invariant mode's kernels), as their `kernels` argument: the set the CPU
    backend registered (lockstep's native kernels where they build, whose bits do not follow the
    CPU's vector unit), else None, PyTorch's."""
    return _KERNEL_SETS.get(cpu_backend())


def cpu_backend_kernels() -> NoReturn:
    """Removed: a block no longer selects the kernels of the calls inside it; pass
    `cpu_backend_kernel_set()` as their `kernels` argument instead."""
    raise removed_selection("lockstep.registry.cpu_backend_kernels",
                            "pass lockstep.registry.cpu_backend_kernel_set() as the `kernels` argument instead")


# (selected backend, device type, op) -> implementation: what `resolve` found, emptied whenever a
# backend registers an op or loads, so that a call does not walk the registry again.
_RESOLVED: dict[tuple[str, str, str], Callable] = {}


def resolve(op: str, device: torch.device) -> Callable:
    """The implementation of `op` for tensors on `device` under the current selection."""
    name = current_backend()
    key = (name, device.type, op)
    impl = _RESOLVED.get(key)
    if impl is None:
        impl = _RESOLVED[key] = _find(name, op, device)
    if RECORDERS:
        return RECORDERS[-1].wrap(op, impl)
    return impl


def fused_form(op: str, name: str, device: torch.device) -> Callable | None:
    """The fused form `name` that the implementation of `op` for `device` carries (linear's `group`,
    rms_norm's `add`, rope's `into_cache`: docs/adr/0042), or None: where a gradient is recorded
    (the forms are forward only), where the backend has none, or while an op recorder wraps the
    ops (its wrappers carry none, so a recorded run sees every op)."""
    if torch.is_grad_enabled():
        return None
    return getattr(resolve(op, device), name, None)


def _find(name: str, op: str, device: torch.device) -> Callable:
    if name == "auto":
        if device.type == "cuda" and _implements("triton", op):
            name = "triton"
        else:
            name = cpu_backend() if device.type == "cpu" else "portable"
    load(name)
    impl = _REGISTRY.get(name, {}).get(op)
    while impl is None and name in _FALLBACK:
        name = _FALLBACK[name]
        load(name)
        impl = _REGISTRY.get(name, {}).get(op)
    if impl is None:
        raise NotImplementedError(f"backend {name!r} has no implementation of {op!r}")
    return impl
