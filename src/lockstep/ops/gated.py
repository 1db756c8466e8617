"""The shared entry of the gated MLP activations (silu_mul, gelu_mul): act(gate) * up."""

from __future__ import annotations

from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import resolve


def gated(op: str, gate: Tensor, up: Tensor) -> Tensor:
    """Validate gate and up ([..., F], one float dtype and device), then run `op`'s kernel on them as
    rows [n, F] under autocast's policy. Returns [..., F] in gate's dtype."""
    gate, up = autocast.cast(op, gate, up)
    if not _well_formed(gate, up):
        _check(gate, up)
    f = gate.shape[-1]
    with autocast.off(gate.device.type):
        y = resolve(op, gate.device)(gate.reshape(-1, f), up.reshape(-1, f))
    return y.reshape(gate.shape)


def _well_formed(gate: object, up: object) -> bool:
    """Whether `_check` would pass, in one expression (the common call pays for no more)."""
    return (isinstance(gate, Tensor) and isinstance(up, Tensor) and gate.dtype in c.FLOAT_DTYPES and gate.dim() >= 1
            and up.dtype == gate.dtype and up.device == gate.device and up.shape == gate.shape)


def _check(gate: object, up: object) -> None:
    c.float_tensor("gate", gate)
    c.float_tensor("up", up)
    c.at_least_1d("gate", gate)
    c.same_dtype("up", up, "gate", gate)
    c.same_device("up", up, "gate", gate)
    if up.shape != gate.shape:
        raise ValueError(f"up: expected shape {tuple(gate.shape)} (the shape of gate), got {tuple(up.shape)}")
