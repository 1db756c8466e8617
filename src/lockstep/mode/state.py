"""The mode's state, shared by its modules: whether strict=True is in force, and whether one of its
kernels is running on this thread (the kernels' own aten calls then go to the stock kernels)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

strict = False                      # set by dispatch.enable for the outermost block
_local = threading.local()


def inside() -> bool:
    """Whether a kernel of the mode is running on this thread."""
    return getattr(_local, "inside", 0) > 0


@contextlib.contextmanager
def kernel() -> Iterator[None]:
    """Mark the block as a kernel of the mode: the aten ops it calls run stock."""
    _local.inside = getattr(_local, "inside", 0) + 1
    try:
        yield
    finally:
        _local.inside -= 1
