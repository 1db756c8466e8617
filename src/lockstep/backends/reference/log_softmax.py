"""Float64 reference log_softmax: the textbook formula, written for clarity; shares no code with the
kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register

f64 = torch.float64


def log_softmax(x: Tensor) -> Tensor:
    x = x.to(f64)
    m = x.max(dim=-1, keepdim=True).values
    return x - m - torch.log(torch.exp(x - m).sum(dim=-1, keepdim=True))


register("reference", "log_softmax")(log_softmax)
