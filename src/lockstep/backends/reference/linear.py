"""Float64 reference linear: the textbook formula, written for clarity; shares no code with the
kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register

f64 = torch.float64


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, split_k: int = 1, split_n: int = 1) -> Tensor:
    # The splits change only the order of float32 sums; in float64 the reference ignores them.
    y = x.to(f64) @ weight.to(f64).T
    return y if bias is None else y + bias.to(f64)


register("reference", "linear")(linear)
