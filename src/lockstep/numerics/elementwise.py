"""Elementwise math whose bits lockstep fixes: exp, log and the square root on the CPU kernels
passed in (MKL's vector math gives them other bits under another instruction set), and SiLU
composed from them in the accumulation dtype. Each is differentiable as torch's own."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .cpu_kernels import CpuKernels, kernels_for
from .tiles import accumulate_dtype

class _OnKernels(torch.autograd.Function):
    """A CPU kernel's exp, log or sqrt, differentiable as torch's own: autograd's formulas for
    torch.exp, torch.log and torch.sqrt (grad * e^x, grad / x, grad / (2 sqrt x)), each an IEEE
    operation, so the gradient's bits are the machine's no more than the value's."""

    @staticmethod
    def forward(ctx, x: Tensor, name: str, kernel: Callable[[Tensor], Tensor]) -> Tensor:
        y = kernel(x)
        ctx.name = name
        ctx.save_for_backward(x if name == "log" else y)      # what the formula needs, as torch keeps
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        (saved,) = ctx.saved_tensors
        if ctx.name == "exp":
            return grad * saved, None, None
        if ctx.name == "log":
            return grad / saved, None, None
        return grad / (2 * saved), None, None


def _on_kernels(name: str, kernel: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """kernel(x), through `_OnKernels` where autograd records it (the kernels see plain data)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _OnKernels.apply(x, name, kernel)
    return kernel(x)


def exp(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """torch.exp, on the CPU kernels `kernels` where they take `x` (same dtype out; differentiable
    either way)."""
    taken = kernels_for(kernels, x, float64=True)
    return torch.exp(x) if taken is None else _on_kernels("exp", taken.exp, x)


def log(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """torch.log, on the CPU kernels `kernels` where they take `x` (same dtype out; differentiable
    either way)."""
    taken = kernels_for(kernels, x, float64=True)
    return torch.log(x) if taken is None else _on_kernels("log", taken.log, x)


def sqrt(x: Tensor, out: Tensor | None = None, *, kernels: CpuKernels | None = None) -> Tensor:
    """torch.sqrt (into `out` when given), on the CPU kernels `kernels` where they take `x`: then
    the correctly rounded root in float64 for float64 x and in fp32 otherwise, and `out` must be of
    that dtype and x's shape. Other devices, and None, take torch.sqrt (on the CPU, MKL's vector
    math). Differentiable either way; with `out`, x must not need a gradient (as torch.sqrt refuses
    it)."""
    taken = kernels_for(kernels, x, float64=True)
    if taken is None or taken.sqrt is None:
        return torch.sqrt(x, out=out)
    if out is None:
        return _on_kernels("sqrt", taken.sqrt, x)
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("out: sqrt into out= does not support automatic differentiation, and x requires grad")
    return taken.sqrt(x, out=out)


def rsqrt(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """torch.rsqrt; on the CPU kernels `kernels`, 1 / their correctly rounded root (what a kernel's
    1.0f / sqrtf gives), since ATen's float64 rsqrt follows the CPU's maker."""
    taken = kernels_for(kernels, x, float64=True)
    if taken is None or taken.sqrt is None:
        return torch.rsqrt(x)
    return torch.reciprocal(_on_kernels("sqrt", taken.sqrt, x))


def silu(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """x * (1 / (1 + exp(-x))) elementwise in the accumulation dtype, x's dtype out: torch.silu's
    value with bits that do not depend on an element's place in the loop. On the fused form of the
    CPU kernels `kernels` where they have one and it takes `x`."""
    taken = kernels_for(kernels, x)
    y = taken.silu(x) if taken is not None and taken.silu is not None else None
    return silu_composed(x, kernels=kernels) if y is None else y


def silu_composed(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """`silu` as PyTorch ops on the exp of `kernels` (the fused forms must give its bits)."""
    xf = x.to(accumulate_dtype(x.dtype))
    return (xf * (1.0 / (1.0 + exp(-xf, kernels=kernels)))).to(x.dtype)


def silu_backward(grad_y: Tensor, x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """d silu(x) = grad_y * (s + x * s * (1 - s)), s = 1 / (1 + exp(-x)), in the accumulation
    dtype, x's dtype out. On the fused form of the CPU kernels `kernels` where they have one and it
    takes `x`."""
    taken = kernels_for(kernels, x)
    dx = taken.silu_backward(grad_y, x) if taken is not None and taken.silu_backward is not None else None
    return silu_backward_composed(grad_y, x, kernels=kernels) if dx is None else dx


def silu_backward_composed(grad_y: Tensor, x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """`silu_backward` as PyTorch ops on the exp of `kernels` (the fused forms must give its bits)."""
    acc = accumulate_dtype(x.dtype)
    xf, dy = x.to(acc), grad_y.to(acc)
    s = 1.0 / (1.0 + exp(-xf, kernels=kernels))
    return (dy * (s + xf * s * (1.0 - s))).to(x.dtype)
