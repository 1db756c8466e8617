"""The mode's switch: `enable()` registers the kernels with torch.library on the CPU (and CUDA, when
present) dispatch keys of the covered aten ops, `disable()` removes them, which restores the stock
kernels. Each call runs the kernel of the route that `routes.route` picks for its tensors' device.
One thread at a time may hold the mode; nesting in that thread is fine."""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Iterator

import torch
from torch import Tensor

from .. import registry
from . import routes, state
from .coverage import UNSUPPORTED

_lock = threading.Lock()
_owner: int | None = None
_depth = 0
_libs: list = []
# The CPU route's table (aten op name -> kernel); `routes` holds every route's.
OVERRIDES = routes.CPU.overrides
# Where another Python library already overrides a covered op (another batch-invariant library, a test's
# BLAS stand-in), the mode's kernel goes over it for the block and the other comes back on exit. torch
# 2.13 allows that by default; torch 2.11 refuses it unless asked (releases without the flag keep their rule).
_OVER_OTHERS = ({"allow_override": True}
                if "allow_override" in inspect.signature(torch.library.Library.impl).parameters else {})


def _device(args, kwargs) -> torch.device:
    """The device of a call: its first tensor argument's."""
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    for a in kwargs.values():
        if isinstance(a, Tensor):
            return a.device
    return torch.device("cpu")


def _make(name: str, original):
    def kernel(keyset, *args, **kwargs):
        if state.inside():
            return original.call_boxed(keyset, *args, **kwargs)
        fn = routes.route(_device(args, kwargs)).overrides.get(name)
        if fn is None:
            return original.call_boxed(keyset, *args, **kwargs)
        # Autocast has already cast this op's inputs; the kernel's own ops must not be cast again.
        with state.kernel(), torch.no_grad(), _no_autocast():
            out = fn(*args, **kwargs)
        if out is None:                               # a case lockstep leaves to the stock kernel
            return original.call_boxed(keyset, *args, **kwargs)
        return out
    kernel.__name__ = f"lockstep_{name.replace('.', '_')}"
    return kernel


def _make_autograd(name: str, original):
    """A kernel at the autograd key of a composite op: the route's kernel builds its own graph (its
    inner aten ops run stock), so grad mode and autocast stay as the caller has them."""
    def kernel(keyset, *args, **kwargs):
        if state.inside():
            return original.call_boxed(keyset, *args, **kwargs)
        fn = routes.route(_device(args, kwargs)).autograd.get(name)
        out = None
        if fn is not None:
            with state.kernel():
                out = fn(*args, **kwargs)
        return original.call_boxed(keyset, *args, **kwargs) if out is None else out
    kernel.__name__ = f"lockstep_autograd_{name.replace('.', '_')}"
    return kernel


def _floats_in(args, kwargs) -> bool:
    items = list(args) + list(kwargs.values())
    flat = [x for a in items for x in (a if isinstance(a, (list, tuple)) else [a])]
    return any(isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) for t in flat)


def _raising(name: str, original):
    def kernel(keyset, *args, **kwargs):
        # Integer and boolean inputs are exact in any order (an attention mask's cumsum): they run stock.
        if state.inside() or not _floats_in(args, kwargs):
            return original.call_boxed(keyset, *args, **kwargs)
        raise RuntimeError(f"lockstep.batch_invariant(strict=True): {name} on floating-point inputs has no "
                           "batch-invariant implementation in lockstep (see lockstep.mode.unsupported())")
    return kernel


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _register(strict: bool) -> None:
    import warnings

    keys = ["CPU"] + (["CUDA"] if torch.cuda.is_available() else [])
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            _register_into(lib, keys, strict)
    except BaseException:
        lib._destroy()              # no op keeps half of the mode
        raise
    _libs.append(lib)


def _register_into(lib, keys: list[str], strict: bool) -> None:
    for key in keys:
        covered = set()
        for name in sorted(routes.names()):
            try:
                original = torch.library.get_kernel(f"aten::{name}", key)
            except (RuntimeError, AttributeError):
                continue              # not in this torch build, or composite (it decomposes into covered ops)
            lib.impl(name, _make(name, original), key, with_keyset=True, **_OVER_OTHERS)
            covered.add(name)
        if key == "CUDA":
            for name in sorted(routes.autograd_names()):
                try:
                    original = torch.library.get_kernel(f"aten::{name}", "AutogradCUDA")
                except (RuntimeError, AttributeError):
                    continue
                lib.impl(name, _make_autograd(name, original), "AutogradCUDA", with_keyset=True, **_OVER_OTHERS)
                covered.add(name)
        if strict:
            for full in UNSUPPORTED:
                name = full.removeprefix("aten::")
                if name in covered:
                    continue
                try:
                    original = torch.library.get_kernel(full, key)
                except (RuntimeError, AttributeError):
                    continue          # composite ops without a backend kernel of their own
                lib.impl(name, _raising(full, original), key, with_keyset=True, **_OVER_OTHERS)


def enable(strict: bool = False) -> None:
    """Turn the mode on for this thread (nestable); see the module docstring."""
    global _owner, _depth
    me = threading.get_ident()
    with _lock:
        if _owner is not None and _owner != me:
            raise RuntimeError(f"lockstep.batch_invariant is already active in thread {_owner}; the mode patches "
                               "process-wide kernels, so one thread at a time may hold it")
        if _depth == 0:
            _register(strict)
            _owner, state.strict = me, strict
            # The CPU route runs on the CPU backend's kernels (kernels.py): its native build, where it
            # builds, happens here rather than inside the first kernel; so does loading the Triton
            # route where CUDA tensors will take it.
            registry.cpu_backend()
            if torch.cuda.is_available():
                routes.route(torch.device("cuda"))
        elif strict and not state.strict:
            raise RuntimeError("lockstep.batch_invariant: cannot enter strict=True inside a non-strict block")
        _depth += 1


def disable() -> None:
    """Leave the mode once; the stock kernels are back when the outermost block exits."""
    global _owner, _depth
    with _lock:
        if _depth == 0:
            return
        if _owner != threading.get_ident():
            raise RuntimeError(f"lockstep.batch_invariant: disable() from a thread that does not hold the mode "
                               f"(held by {_owner})")
        _depth -= 1
        if _depth == 0:
            while _libs:
                _libs.pop()._destroy()
            _owner = None


def is_enabled() -> bool:
    return _depth > 0


@contextlib.contextmanager
def batch_invariant(strict: bool = False) -> Iterator[None]:
    """`with lockstep.batch_invariant():` PyTorch's matmuls, softmaxes, sums, means, RMSNorm and
    scaled_dot_product_attention run lockstep's invariant kernels; everything is restored on exit,
    also on an exception. strict=True raises on the first use of an unsupported op."""
    enable(strict)
    try:
        yield
    finally:
        disable()
