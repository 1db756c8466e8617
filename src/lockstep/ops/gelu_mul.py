"""gelu_mul: gelu_tanh(gate) * up, the GeGLU activation of Gemma's MLP."""

from __future__ import annotations

from torch import Tensor

from .gated import gated


def gelu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """gelu(gate, approximate="tanh") * up. gate, up: [..., F] of one dtype and device.

    Returns [..., F] in gate's dtype; fp32 inside (float64 for float64 inputs). The tanh form is
    computed as gate * sigmoid(2u), u = sqrt(2 / pi) * (gate + 0.044715 gate^3), which is the same
    function and uses only primitives whose bits do not depend on the code path."""
    return gated("gelu_mul", gate, up)
