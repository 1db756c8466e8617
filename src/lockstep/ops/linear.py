"""linear: y = x @ weight.T + bias, row-invariant."""

from __future__ import annotations

from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import resolve


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x @ weight.T + bias.

    x: [..., K] float; weight: [N, K] (nn.Linear layout) and bias: [N], both of x's dtype and device.
    Returns [..., N] in x's dtype; fp32 accumulation. Every leading index of x is an independent row.
    """
    x, weight, bias = autocast.cast("linear", x, weight, bias)
    c.float_tensor("x", x)
    c.at_least_1d("x", x)
    c.float_tensor("weight", weight)
    c.ndim("weight", weight, 2, "a 2-D weight [out_features, in_features]")
    c.same_dtype("weight", weight, "x", x)
    c.same_device("weight", weight, "x", x)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight: expected shape [N, {x.shape[-1]}] to match x's last dimension, got {tuple(weight.shape)}")
    if bias is not None:
        c.float_tensor("bias", bias)
        c.same_dtype("bias", bias, "x", x)
        c.same_device("bias", bias, "x", x)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    with autocast.off(x.device.type):
        y = resolve("linear", x.device)(rows, weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])
