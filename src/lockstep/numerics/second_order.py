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


def _refusal(op: str) -> str:
    return (f"{op}: a second derivative through lockstep's {op} was asked for (create_graph=True), and its "
            "backward is not differentiable; run the model under the 'eager' backend "
            "(lockstep.registry.use_backend('eager')) for higher-order gradients")


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
        raise RuntimeError(_refusal(ctx.op))


class _SavedOnce:
    """ctx with its saved tensors unpacked once: a non-reentrant checkpoint refuses a second unpack,
    and the backward and the mark both need them."""

    def __init__(self, ctx):
        self._ctx, self.saved_tensors = ctx, ctx.saved_tensors

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)


def first_order_only(op: str) -> Callable:
    """Decorator of an autograd Function's backward (below @staticmethod): under create_graph, run
    it without recording and return its gradients marked (see the module docstring). Where no
    tensor links the gradient to the op's inputs (no saved input and no incoming gradient needs a
    gradient, as when cross entropy's output is the loss itself), a mark could not be reached, so
    it raises at once instead."""
    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapped(ctx, *grads):
            if not torch.is_grad_enabled():
                return backward(ctx, *grads)
            saved = _SavedOnce(ctx)
            inputs = [t for t in (*saved.saved_tensors, *grads) if isinstance(t, Tensor) and t.requires_grad]
            if not inputs:
                raise RuntimeError(_refusal(op))
            with torch.no_grad():
                result = backward(saved, *grads)
            if isinstance(result, tuple):
                return tuple(_Refuse.apply(g.detach(), op, *inputs) if _floating(g) else g for g in result)
            return _Refuse.apply(result.detach(), op, *inputs) if _floating(result) else result
        return wrapped
    return decorate


def _floating(t) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()
