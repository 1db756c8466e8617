"""Which CPU kernels carry the arithmetic whose bits a library may choose: PyTorch's, in the fixed
tiles of `lockstep.numerics.gemm`, or a backend's own set (the native backend's, lockstep's C
kernels: `lockstep.backends.native.cpu.KERNELS`). The set is an argument: each backend op passes
its own (the portable backend None, PyTorch's) through the portable compositions to the
fixed-order functions, and autograd Functions keep it on ctx for their backward, which may run on
another thread. Every fixed-order function that has a kernel form asks `kernels_for` whether the
set takes its tensor."""

from __future__ import annotations

from typing import Callable, NamedTuple, NoReturn

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
    `matmul_rows` computes it; `silu` and `silu_backward` (same signatures), or None where they
    decline (then the composition runs, on this set's exp); and `weight_grad_node`
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
    silu: Callable[[Tensor], Tensor | None] | None = None
    silu_backward: Callable[[Tensor, Tensor], Tensor | None] | None = None
    weight_grad_node: Callable[[Tensor, Tensor, list[int], Tensor], Tensor | None] | None = None
    sqrt: Callable[..., Tensor] | None = None
    columns_at_any_width: bool = False


def kernels_for(kernels: CpuKernels | None, t: Tensor, float64: bool = False) -> CpuKernels | None:
    """`kernels` where they take `t`, else None for PyTorch's own: the kernels take CPU tensors
    alone, and float64 ones only where the caller's form is one of the five that take it
    (`float64`)."""
    if kernels is None or t.device.type != "cpu" or (t.dtype == torch.float64 and not float64):
        return None
    return kernels


def columns_at_any_width(t: Tensor, *, kernels: CpuKernels | None = None) -> bool:
    """Whether `matmul_rows` with `t` as its first operand gives each column of the product the same
    bits at any width: on `kernels` where they take `t` and say so (the native ones), never on
    PyTorch's GEMMs, whose columns may follow the call's width (`torch_gemm_broken_premises`'s
    "column widths")."""
    taken = kernels_for(kernels, t)
    return taken is not None and taken.columns_at_any_width


# The per-thread selection these names made hid which kernels a call ran on from anyone reading the
# call; they stay importable, for code that still names them, and each says what replaced it.
_EXPLICIT = ("pass the kernel set as the `kernels` argument instead (lockstep.backends.native.cpu.KERNELS, "
             "lockstep.registry.cpu_backend_kernel_set(), or None for PyTorch's)")
_ON_CTX = "take the kernel set as an argument of forward, keep it on ctx and pass it as `kernels` in backward"


def removed_selection(name: str, instead: str = _EXPLICIT) -> RuntimeError:
    """The error of a removed selection name (`name`, its full path), saying what to do instead."""
    return RuntimeError(f"{name}: the CPU kernels are no longer selected per thread; {instead}")


def _removed(name: str, instead: str = _EXPLICIT) -> RuntimeError:
    return removed_selection(f"lockstep.numerics.cpu_kernels.{name}", instead)


def register_cpu_kernels(kernels: CpuKernels) -> NoReturn:
    """Removed: a kernel set is passed as an argument, not registered under a name and selected."""
    raise _removed("register_cpu_kernels", "a backend registers its set with lockstep.registry.register_kernel_set, "
                   "and callers pass it as the `kernels` argument")


def current_cpu_kernels() -> NoReturn:
    """Removed: no kernel set is selected per thread; a function's `kernels` argument names it."""
    raise _removed("current_cpu_kernels")


def cpu_kernels(name: str) -> NoReturn:
    """Removed: a block no longer selects the kernels of the calls inside it."""
    raise _removed("cpu_kernels")


def records_cpu_kernels(forward: Callable) -> NoReturn:
    """Removed: an autograd Function keeps its kernel set on ctx in forward."""
    raise _removed("records_cpu_kernels", _ON_CTX)


def restores_cpu_kernels(backward: Callable) -> NoReturn:
    """Removed: an autograd Function's backward passes the kernel set its forward kept on ctx."""
    raise _removed("restores_cpu_kernels", _ON_CTX)


def selected_kernels(t: Tensor, float64: bool = False) -> NoReturn:
    """Removed: `kernels_for(kernels, t, float64)` applies the same rules to a set passed in."""
    raise _removed("selected_kernels", "use kernels_for(kernels, t, float64) on the kernel set passed in")
