"""The host work around the kernels, counted: reads of tensor data back to the host and aten ops.

On a GPU each read of a tensor's data (`item`, `tolist`, `bool(t)`, `int(t)`, `float(t)`, an index
taken from a tensor, `numpy`, `cpu`) waits for the device, and each aten op that is not a view is a
kernel launch. On a CPU neither costs much, so a step's host work is counted rather than timed:

    with HostWork() as work:
        engine.step()
    work.reads        # Counter: {"tolist": 3, "item": 1, ...}
    work.ops          # Counter of the non-view aten ops that compute: {"aten.mm": 8, ...}
    work.allocations  # Counter of the ops that only allocate: {"aten.empty": 2, ...}

Reads are counted where Python asks for the data (the Tensor methods above, patched for the block
and restored after it); a read that C++ makes inside an op is not seen, which on a GPU the
profiler's launch count covers. Ops are counted by a TorchDispatchMode, so they include the ops a
backend runs inside its own Python, but not a Triton kernel's launch. Under Triton's interpreter
(no GPU) each kernel launch is counted in `launches`, by kernel name, and the interpreter's own
copies in and out of the kernel are not counted as ops or reads: on a GPU they do not happen.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostWork", "READS"]

# Tensor methods that hand a tensor's data to Python, by the name a count uses.
READS = {"item": "item", "tolist": "tolist", "__bool__": "bool", "__int__": "int", "__float__": "float",
         "__index__": "index", "numpy": "numpy", "cpu": "cpu"}
# aten ops that only allocate memory (no arithmetic, no copy); on a GPU they launch nothing.
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# The op behind item(), bool(t), int(t) and float(t): counted as a read, not as an op.
_SCALAR_READ = "_local_scalar_dense"


class _Ops(TorchDispatchMode):
    def __init__(self, work: "HostWork"):
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name != _SCALAR_READ and not self.work._in_launch:
            (self.work.allocations if name in _ALLOCATIONS else self.work.ops)[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


class HostWork:
    """Counts, in the thread that enters it, the reads of tensor data to the host (`reads`, by
    method) and the non-view aten ops (`ops`, and `allocations` for those that only allocate) run
    inside the block, and the Triton kernels launched under the interpreter (`launches`). One block
    at a time per process: the Tensor methods are patched for its duration."""

    _active: "HostWork | None" = None
    _lock = threading.Lock()

    def __init__(self):
        self.reads: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()
        self.allocations: collections.Counter[str] = collections.Counter()
        self.launches: collections.Counter[str] = collections.Counter()
        self._in_launch = 0
        self._saved: dict[str, object] = {}
        self._mode: _Ops | None = None
        self._thread: int | None = None

    @property
    def total_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    def _counting(self, method: str, kind: str):
        original = getattr(torch.Tensor, method)
        work = self

        def counted(tensor, *args, **kwargs):
            if threading.get_ident() == work._thread and not work._in_launch:
                work.reads[kind] += 1
            return original(tensor, *args, **kwargs)

        counted.__name__ = method
        return counted

    def __enter__(self) -> "HostWork":
        with HostWork._lock:
            if HostWork._active is not None:
                raise RuntimeError("HostWork: another block is counting in this process; one at a time")
            HostWork._active = self
        self._thread = threading.get_ident()
        for method, kind in READS.items():
            self._saved[method] = torch.Tensor.__dict__.get(method)
            setattr(torch.Tensor, method, self._counting(method, kind))
        self._grid_call = self._count_interpreted_launches()
        self._mode = _Ops(self)
        self._mode.__enter__()
        return self

    def _count_interpreted_launches(self):
        """Patches the interpreter's launch (when Triton runs interpreted in this process) to count
        it and to hide its copies; returns the original, or None."""
        interpreter = sys.modules.get("triton.runtime.interpreter")
        if interpreter is None or os.environ.get("TRITON_INTERPRET") != "1":
            return None
        original = interpreter.GridExecutor.__call__
        work = self

        def launch(executor, *args, **kwargs):
            if threading.get_ident() != work._thread:
                return original(executor, *args, **kwargs)
            work.launches[executor.fn.__name__] += 1
            work._in_launch += 1
            try:
                return original(executor, *args, **kwargs)
            finally:
                work._in_launch -= 1

        interpreter.GridExecutor.__call__ = launch
        return original

    def __exit__(self, *exc) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            if self._grid_call is not None:
                sys.modules["triton.runtime.interpreter"].GridExecutor.__call__ = self._grid_call
                self._grid_call = None
            for method, saved in self._saved.items():
                if saved is None:
                    delattr(torch.Tensor, method)
                else:
                    setattr(torch.Tensor, method, saved)
            self._saved.clear()
            with HostWork._lock:
                HostWork._active = None
