"""log_softmax over the last dimension."""

from __future__ import annotations

from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import resolve


def log_softmax(x: Tensor) -> Tensor:
    """log_softmax over the last dimension. x: [..., V] float. Returns [..., V] in x's dtype; fp32 inside."""
    (x,) = autocast.cast("log_softmax", x)
    c.float_tensor("x", x)
    c.at_least_1d("x", x)
    if x.shape[-1] == 0:
        raise ValueError("x: expected a non-empty last dimension")
    with autocast.off(x.device.type):
        y = resolve("log_softmax", x.device)(x.reshape(-1, x.shape[-1]))
    return y.reshape(x.shape)
