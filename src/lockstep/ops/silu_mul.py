"""silu_mul: silu(gate) * up, the gated MLP activation (SwiGLU)."""

from __future__ import annotations

from torch import Tensor

from .gated import gated


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up. gate, up: [..., F] of one dtype and device. Returns [..., F]; fp32 inside."""
    return gated("silu_mul", gate, up)
