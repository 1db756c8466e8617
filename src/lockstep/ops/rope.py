"""rope: rotary position embedding at arbitrary positions."""

from __future__ import annotations

import math

from torch import Tensor

from .. import checks as c
from ..registry import resolve
from ..rotary import (MAX_POSITION, Llama3RopeScaling, LinearRopeScaling, Positions, RopeScaling, TablePositions,
                      position_tensor)

STYLES = ("neox", "gptj")


def rope(x: Tensor, positions: Tensor | Positions | TablePositions, theta: float = 10000.0, style: str = "neox",
         scaling: RopeScaling | None = None) -> Tensor:
    """Rotate x by its positions.

    x: [tokens, heads, head_dim] float (head_dim even); positions: [tokens] int, values in
    [0, 2^24) (rotary.MAX_POSITION: beyond, the angles would leave the tables' exact range), or a
    rotary.Positions, which brings the host's copy of its values so that nothing is read back from
    the device (a model's forward makes one per step and rotates every layer by it), or a
    rotary.TablePositions, whose bound its maker checked (angles gathered on the device).
    style "neox" rotates the two halves of head_dim against each other (Llama, Qwen); "gptj" rotates
    interleaved pairs. scaling: Llama 3 or linear frequency scaling. Returns x's shape and dtype; angles in float64, rotation in fp32.
    """
    positions = checked(x, positions, theta, style, scaling)
    return resolve("rope", x.device)(x, positions, float(theta), style, scaling)


def checked(x: Tensor, positions: Tensor | Positions | TablePositions, theta: float, style: str,
            scaling: RopeScaling | None) -> Positions | TablePositions:
    """rope's checks of its arguments, each failure named; returns the positions as the backends
    take them (a tensor read once into a Positions)."""
    c.float_tensor("x", x)
    c.ndim("x", x, 3, "a 3-D tensor [tokens, heads, head_dim]")
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even head_dim, got {x.shape[-1]}")
    if not isinstance(positions, (Positions, TablePositions)):
        c.int_tensor("positions", positions)
    tensor = position_tensor(positions)
    c.same_device("positions", tensor, "x", x)
    if tuple(tensor.shape) != (x.shape[0],):
        raise ValueError(f"positions: expected shape [{x.shape[0]}] (one per token of x), got {tuple(tensor.shape)}")
    if not isinstance(positions, (Positions, TablePositions)):
        positions = Positions.read(positions)       # the one read of the device
    if isinstance(positions, Positions) and positions.host.numel():
        if positions.low < 0:
            raise ValueError(f"positions: expected values >= 0, found {positions.low}")
        if positions.high >= MAX_POSITION:
            raise ValueError(f"positions: expected values below 2^24 = {MAX_POSITION}, found {positions.high}")
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
        raise ValueError(f"theta: expected a finite number > 1, got {theta!r}")
    if style not in STYLES:
        raise ValueError(f"style: expected one of {STYLES}, got {style!r}")
    if scaling is not None and not isinstance(scaling, (Llama3RopeScaling, LinearRopeScaling)):
        raise TypeError(f"scaling: expected a Llama3RopeScaling, a LinearRopeScaling or None, got {type(scaling).__name__}")
    return positions
