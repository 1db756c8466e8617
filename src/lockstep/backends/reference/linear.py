"""Float64 reference linear: the textbook formula, written for clarity; shares no code with the
kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register

f64 = torch.float64


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    y = x.to(f64) @ weight.to(f64).T
    return y if bias is None else y + bias.to(f64)


register("reference", "linear")(linear)
