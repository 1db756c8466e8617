"""Which kernels the mode runs for a call: a route per device (docs/adr/0039).

- `CPU`: `kernels` and `attention` on the CPU backend's kernels (native where it builds); on a
  device without a Triton route, the same code on PyTorch's own ops in fixed tile shapes.
- `triton_route()`: the Triton backend's kernels for the GEMM family, RMSNorm, the softmax family
  and attention (`triton_kernels`); the ops it does not override, and float64, take the CPU route's.

`route(device)` picks one: Triton for CUDA tensors where Triton loads, else CPU. The dispatcher
asks it on every call through this module's attribute, so a test can point CPU tensors at the
Triton route (under Triton's interpreter) by replacing `route`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import registry
from . import attention, kernels


@dataclass(frozen=True)
class Route:
    """A set of the mode's kernels: `overrides` maps aten op names (as torch.library names them) to
    kernels; `autograd` maps composite ops to kernels registered at their autograd key; `backend` is
    the registry backend its ops run on (None: the one the registry selects)."""
    name: str
    overrides: dict[str, Callable]
    autograd: dict[str, Callable] = field(default_factory=dict)
    backend: str | None = None


# The math form's kernel is registered on CUDA's autograd key only: on a CPU the mode leaves it stock.
CPU = Route("cpu", {**kernels.OVERRIDES, **attention.OVERRIDES},
            {"_scaled_dot_product_attention_math": attention.math_override(None)})


@functools.cache
def triton_route() -> Route:
    """The Triton route; raises registry.BackendUnavailable where the Triton backend cannot load."""
    registry.load("triton")
    from . import triton_kernels

    return Route("triton", {**triton_kernels.overrides(CPU.overrides), **attention.overrides("triton")},
                 {"_scaled_dot_product_attention_math": attention.math_override("triton")}, "triton")


@functools.cache
def _triton_loads() -> bool:
    try:
        triton_route()
    except ImportError:
        return False
    return True


def route(device: torch.device) -> Route:
    """The route for tensors on `device`: the Triton route for CUDA where the Triton backend loads,
    else the CPU route."""
    if device.type == "cuda" and _triton_loads():
        return triton_route()
    return CPU


def names() -> set[str]:
    """Every aten op name the routes override at a backend key (the Triton route's are among the CPU
    route's, so no route is asked to load here)."""
    return set(CPU.overrides)


def autograd_names() -> set[str]:
    """Every composite aten op name the routes override at CUDA's autograd key."""
    return set(CPU.autograd)
