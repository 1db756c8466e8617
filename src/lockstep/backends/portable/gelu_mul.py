"""Portable gelu_mul, from primitives whose bits do not depend on the code path.

torch.tanh, like torch.sigmoid, gives other fp32 bits in the scalar tail of its vector loop than in
the body. gelu_tanh(g) = 0.5 g (1 + tanh(u)) equals g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3),
and the sigmoid is written with exp and a reciprocal, which are path-independent
(tests/test_portable.py guards this). The chain runs on cache-sized row chunks, as silu_mul's.
"""

from __future__ import annotations

import math

from torch import Tensor

from ...numerics.cpu_kernels import CpuKernels
from ...registry import register
from .silu_mul import GatedMul, sigmoid

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


def _two_u(g: Tensor) -> Tensor:
    """2u = 2 sqrt(2/pi) (g + 0.044715 g^3), evaluated as g * (c1 + c3 * g * g)."""
    return (g * g).mul_(2.0 * SQRT_2_OVER_PI * CUBIC).add_(2.0 * SQRT_2_OVER_PI).mul_(g)


def gelu_tanh(g: Tensor, *, kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    """(sigmoid(2u), gelu_tanh(g)) of an accumulation-dtype tensor, the exp on the CPU kernels
    `kernels` (None: PyTorch's); also batch_invariant()'s aten::gelu."""
    s = sigmoid(_two_u(g), kernels=kernels)
    return s, g * s


def gelu_tanh_derivative(g: Tensor, s: Tensor, gelu: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """d gelu_tanh / dg = s + g s (1 - s) d(2u)/dg, d(2u)/dg = 2 sqrt(2/pi) (1 + 3 * 0.044715 g^2),
    for s = sigmoid(2u) and gelu = g s of the same g (`gelu_tanh`'s, on the same `kernels`)."""
    # 1 - s is sigmoid(-2u), not 1 - s: where s is near 1 the subtraction keeps only the digits s
    # does not share with 1, and d(2u)/dg grows with g^2, which put the fp32 gradient at 2-4x
    # eager PyTorch's error (the contract allows 2x).
    d2u = (g * g).mul_(2.0 * SQRT_2_OVER_PI * 3.0 * CUBIC).add_(2.0 * SQRT_2_OVER_PI)
    return sigmoid(_two_u(g).neg_(), kernels=kernels).mul_(gelu).mul_(d2u).add_(s)


def _gelu(g: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    return gelu_tanh(g, kernels=kernels)[1]


def _gelu_and_derivative(g: Tensor, *, kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    s, gelu = gelu_tanh(g, kernels=kernels)
    return gelu, gelu_tanh_derivative(g, s, gelu, kernels=kernels)


@register("portable", "gelu_mul")
def gelu_mul(gate: Tensor, up: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """The portable gelu_mul, its exp on the CPU kernels `kernels` (None: PyTorch's)."""
    return GatedMul.apply(gate.contiguous(), up.contiguous(), _gelu, _gelu_and_derivative, kernels)
