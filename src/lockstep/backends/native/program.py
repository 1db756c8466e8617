"""The native kernel calls a thread makes while it records, kept to be made again: how the engine
replays a captured decode step on the CPU (lockstep.engine.step_graph).

`build.library()` hands a recording thread its library wrapped: each entry point call runs, and is
kept with its arguments (the addresses of its tensors, its sizes) and what it returned. A replay
makes the same calls, in order, on the same memory."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


class Recording:
    """The calls recorded in one thread: `entries` holds ("native", function, arguments, returned)
    in call order; a caller may add its own entries to the same list (the step graph adds the
    aten ops that run between the kernels)."""

    def __init__(self) -> None:
        self.entries: list[tuple] = []

    def wrap(self, lib):
        return _Recorded(lib, self.entries)


class _Recorded:
    """A kernel library whose entry points record each call into `entries`."""

    def __init__(self, lib, entries: list[tuple]):
        self._lib, self._entries = lib, entries

    def __getattr__(self, name: str):
        fn, entries = getattr(self._lib, name), self._entries

        def recorded(*args):
            result = fn(*args)
            entries.append(("native", fn, args, result))
            return result

        return recorded


def active() -> Recording | None:
    """The recording of this thread, or None."""
    return getattr(_state, "recording", None)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Inside the block, this thread's kernel calls are recorded (and made)."""
    previous, _state.recording = active(), Recording()
    try:
        yield _state.recording
    finally:
        _state.recording = previous
