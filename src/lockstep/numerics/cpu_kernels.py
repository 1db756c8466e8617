"""Which CPU kernels carry the arithmetic whose bits a library may choose: PyTorch's, in the fixed
tiles of `lockstep.numerics.gemm`, or a backend's own (the native backend registers lockstep's C
kernels). The choice is per thread, made by a `cpu_kernels` block; autograd Functions record it in
forward and restore it in backward, which may run on another thread. Every fixed-order function that
has a kernel form asks `selected_kernels` for the set that takes its tensor."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor

class CpuKernels(NamedTuple):
    """A set of CPU kernels for the arithmetic whose bits a library may choose: the GEMMs of
    `matmul_rows` and `weight_grad` (same signatures), and `exp` and `log` (fp32 in, fp32 out; MKL's
    vector math gives them other bits under another instruction set). These, and `sqrt`, also take
    float64 (float64 out); the other forms are called for 16- and 32-bit floats alone. Optionally,
    faster forms of compositions whose bits are fixed here, which must give those bits: `row_sum` (fp32 [M, L] ->
    [M]), and `log_softmax` (fp32 [M, V] -> y) with its `log_softmax_backward` (g, y -> dx), the
    arithmetic of `log_softmax_rows` and `log_softmax_rows_backward` on their own exp and log;
    `lse_fold` and `logit_grad`, the LM head's per-chunk row arithmetic (same signatures; lse_fold's
    width included);
    `split_matmul_rows` (a, b, parts), the reduction over K in `parts` slices as `split_sum` of
    `matmul_rows` computes it; `silu` and `silu_backward` (same signatures); and `weight_grad_node`
    (grad_out, inp, bounds, out), `weight_grad_node`'s unit tree in one call, or None where it
    declines (then the composition runs); and `sqrt` (x, out=None), a correctly rounded square
    root, fp32 or float64 (MKL's vector math, which torch.sqrt takes, is not).
    `columns_at_any_width`: whether `matmul_rows` gives a column the same bits whatever the
    product's width (each dot computed by itself), so that a caller may take chunks of columns from
    one wider call."""
    name: str
    matmul_rows: Callable[..., Tensor]
    weight_grad: Callable[..., Tensor]
    exp: Callable[[Tensor], Tensor]
    log: Callable[[Tensor], Tensor]
    row_sum: Callable[[Tensor], Tensor] | None = None
    log_softmax: Callable[[Tensor], Tensor] | None = None
    log_softmax_backward: Callable[[Tensor, Tensor], Tensor] | None = None
    lse_fold: Callable[..., tuple[Tensor, Tensor]] | None = None
    logit_grad: Callable[..., Tensor] | None = None
    split_matmul_rows: Callable[[Tensor, Tensor, int], Tensor] | None = None
    silu: Callable[[Tensor], Tensor] | None = None
    silu_backward: Callable[[Tensor, Tensor], Tensor] | None = None
    weight_grad_node: Callable[[Tensor, Tensor, list[int], Tensor], Tensor | None] | None = None
    sqrt: Callable[..., Tensor] | None = None
    columns_at_any_width: bool = False


_CPU_KERNELS: dict[str, CpuKernels] = {}
_kernels_state = threading.local()


def register_cpu_kernels(kernels: CpuKernels) -> None:
    """Make `kernels` selectable by `cpu_kernels(kernels.name)` (the native backend registers its own)."""
    _CPU_KERNELS[kernels.name] = kernels


def current_cpu_kernels() -> str:
    """The CPU kernels selected for this thread: "torch" (PyTorch's, in fixed tiles) unless a
    `cpu_kernels` block says otherwise. Autograd Functions record it in forward and restore it in
    backward, which may run on another thread."""
    stack = getattr(_kernels_state, "stack", None)
    return stack[-1] if stack else "torch"


@contextlib.contextmanager
def cpu_kernels(name: str) -> Iterator[None]:
    """Run `matmul_rows`, `weight_grad`, `exp`, `log` and `sqrt` on CPU tensors with kernels `name`
    in the block."""
    if name != "torch" and name not in _CPU_KERNELS:
        raise ValueError(f"name: unknown CPU kernels {name!r}; expected one of {['torch', *_CPU_KERNELS]}")
    stack = getattr(_kernels_state, "stack", None)
    if stack is None:
        stack = _kernels_state.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def records_cpu_kernels(forward: Callable) -> Callable:
    """Decorator of an autograd Function's forward: remember the CPU kernels it ran with (see
    `restores_cpu_kernels`)."""
    @functools.wraps(forward)
    def wrapped(ctx, *args, **kwargs):
        ctx.cpu_kernels = current_cpu_kernels()
        return forward(ctx, *args, **kwargs)
    return wrapped


def restores_cpu_kernels(backward: Callable) -> Callable:
    """Decorator of an autograd Function's backward: run it on the CPU kernels its forward ran with,
    whichever thread autograd runs it on."""
    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        with cpu_kernels(ctx.cpu_kernels):
            return backward(ctx, *grads)
    return wrapped


def selected_kernels(t: Tensor, float64: bool = False) -> CpuKernels | None:
    """The selected kernels that take `t`, or None for PyTorch's own (any device but the CPU, none
    selected, or float64 where the caller's form is not one of the five that take it)."""
    name = current_cpu_kernels()
    if name == "torch" or t.device.type != "cpu" or (t.dtype == torch.float64 and not float64):
        return None
    return _CPU_KERNELS[name]


def columns_at_any_width(t: Tensor) -> bool:
    """Whether `matmul_rows` with `t` as its first operand gives each column of the product the same
    bits at any width: on the selected CPU kernels where they say so (the native ones), never on
    PyTorch's GEMMs, whose columns may follow the call's width (`torch_gemm_broken_premises`'s
    "column widths")."""
    kernels = selected_kernels(t)
    return kernels is not None and kernels.columns_at_any_width
