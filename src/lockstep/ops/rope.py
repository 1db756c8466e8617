"""rope: rotary position embedding at arbitrary positions."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import checks as c
from ..registry import resolve
from ..rotary import MAX_POSITION, Llama3RopeScaling, LinearRopeScaling, RopeScaling

STYLES = ("neox", "gptj")


def rope(x: Tensor, positions: Tensor, theta: float = 10000.0, style: str = "neox",
         scaling: RopeScaling | None = None) -> Tensor:
    """Rotate x by its positions.

    x: [tokens, heads, head_dim] float (head_dim even); positions: [tokens] int, values in
    [0, 2^24) (rotary.MAX_POSITION: beyond, the angles would leave the tables' exact range).
    style "neox" rotates the two halves of head_dim against each other (Llama, Qwen); "gptj" rotates
    interleaved pairs. scaling: Llama 3 or linear frequency scaling. Returns x's shape and dtype; angles in float64, rotation in fp32.
    """
    c.float_tensor("x", x)
    c.ndim("x", x, 3, "a 3-D tensor [tokens, heads, head_dim]")
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even head_dim, got {x.shape[-1]}")
    c.int_tensor("positions", positions)
    c.same_device("positions", positions, "x", x)
    if tuple(positions.shape) != (x.shape[0],):
        raise ValueError(f"positions: expected shape [{x.shape[0]}] (one per token of x), got {tuple(positions.shape)}")
    if positions.numel():
        low, high = torch.stack(tuple(torch.aminmax(positions))).tolist()      # one read of the device
        if low < 0:
            raise ValueError(f"positions: expected values >= 0, found {low}")
        if high >= MAX_POSITION:
            raise ValueError(f"positions: expected values below 2^24 = {MAX_POSITION}, found {high}")
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
        raise ValueError(f"theta: expected a finite number > 1, got {theta!r}")
    if style not in STYLES:
        raise ValueError(f"style: expected one of {STYLES}, got {style!r}")
    if scaling is not None and not isinstance(scaling, (Llama3RopeScaling, LinearRopeScaling)):
        raise TypeError(f"scaling: expected a Llama3RopeScaling, a LinearRopeScaling or None, got {type(scaling).__name__}")
    return resolve("rope", x.device)(x, positions.long(), float(theta), style, scaling)
