"""Float64 reference embedding: the textbook formula, written for clarity; shares no code with the
kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register

f64 = torch.float64


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return weight.to(f64)[ids]


register("reference", "embedding")(embedding)
