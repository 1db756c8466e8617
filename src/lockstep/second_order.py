"""Second derivatives through lockstep's ops are refused, not approximated (docs/adr/0023).

An op's backward runs C or Triton kernels, in-place fixed-order compositions, or reuses statistics
its forward saved without a graph (rms_norm's rstd, cross entropy's log-sum-exp), so the gradient
it returns is not a differentiable function of the op's inputs. Under `create_graph=True` autograd
would treat it as one and silently leave out the missing terms. `first_order_only` instead marks
each gradient so that differentiating it raises an error that names the op; the gradient itself,
and everything that does not differentiate it, is unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor


class _Refuse(torch.autograd.Function):
    """Passes a gradient through; differentiating it raises. The tensors the gradient depends on (the
    op's saved inputs, the incoming gradients) come along, so that the mark lies on every path from
    the gradient to what it depends on."""

    @staticmethod
    def forward(ctx, grad: Tensor, op: str, *inputs: Tensor) -> Tensor:
        ctx.op = op
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"{ctx.op}: a second derivative through lockstep's {ctx.op} was asked for (create_graph=True), and its "
            "backward is not differentiable; run the model under the 'eager' backend "
            "(lockstep.registry.use_backend('eager')) for higher-order gradients")


def _marked(grad, op: str, inputs: list[Tensor]):
    if not isinstance(grad, Tensor) or not grad.is_floating_point():
        return grad
    if not inputs:
        return _Refuse.apply(grad.detach().requires_grad_(), op)
    return _Refuse.apply(grad.detach(), op, *inputs)


def first_order_only(op: str) -> Callable:
    """Decorator of an autograd Function's backward (below @staticmethod): under create_graph, run
    it without recording and return its gradients marked (see the module docstring)."""
    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapped(ctx, *grads):
            if not torch.is_grad_enabled():
                return backward(ctx, *grads)
            with torch.no_grad():
                result = backward(ctx, *grads)
            inputs = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, Tensor) and t.requires_grad]
            if isinstance(result, tuple):
                return tuple(_marked(g, op, inputs) for g in result)
            return _marked(result, op, inputs)
        return wrapped
    return decorate
