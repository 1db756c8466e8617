"""silu_mul: silu(gate) * up, the gated MLP activation."""

from __future__ import annotations

from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import resolve


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up. gate, up: [..., F] of one dtype and device. Returns [..., F]; fp32 inside."""
    gate, up = autocast.cast("silu_mul", gate, up)
    c.float_tensor("gate", gate)
    c.float_tensor("up", up)
    c.at_least_1d("gate", gate)
    c.same_dtype("up", up, "gate", gate)
    c.same_device("up", up, "gate", gate)
    if up.shape != gate.shape:
        raise ValueError(f"up: expected shape {tuple(gate.shape)} (the shape of gate), got {tuple(up.shape)}")
    f = gate.shape[-1]
    with autocast.off(gate.device.type):
        y = resolve("silu_mul", gate.device)(gate.reshape(-1, f), up.reshape(-1, f))
    return y.reshape(gate.shape)
