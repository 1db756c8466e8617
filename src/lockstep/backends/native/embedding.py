"""Native embedding: the portable op, a gather forward and elementwise adds in a fixed order
backward, with no GEMM, exp or log to run on lockstep's kernels: the same bits on every CPU."""

from __future__ import annotations

from torch import Tensor

from ...registry import register
from ..portable import embedding as portable


@register("native", "embedding")
def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return portable.embedding(ids, weight)
