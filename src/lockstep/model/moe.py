"""A sparse mixture-of-experts MLP (Qwen3-MoE) whose every token's bits are its own.

What a token computes must not depend on which other tokens share the call, on their order, or on
how many of them chose the same expert (docs/adr/0008-mixture-of-experts.md):

- Router: fp32 probabilities exp(log_softmax(x @ gate.T)), the exp on the CPU backend's kernels
  (PyTorch's fp32 exp may take MKL's vector math, ADR 0010), then the top k by a stable descending
  sort (ties: the lower expert index first), optionally renormalised by their sum in slot order,
  whose backward sums in slot order too.
- Experts: each expert is a gated MLP of lockstep ops, run on the rows that chose it, gathered in
  token order. ops.linear is row-invariant, so a row's output does not depend on how many rows the
  expert got.
- Combine: a token's k weighted expert outputs are added in ascending expert order, in fp32, then
  rounded once to the model's dtype. The backward of the gather is the same fixed sum, so
  d(hidden) is deterministic too; no index_add, no atomics.
- Weight gradients: each expert's linears reduce over its rows in fixed row blocks; inside a
  layout-invariant window (lockstep.numerics.grad_tree) by unit, like every other weight. Every expert runs
  on every call that needs gradients, with zero rows when none chose it, so each unit feeds every
  expert's tree whatever the layout.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from ..numerics import grad_tree
from .. import ops
from ..numerics.fixed_order import accumulate_dtype, exp, row_sum
from ..registry import cpu_backend_kernel_set

_ROUTER_LOGITS: contextvars.ContextVar[list | None] = contextvars.ContextVar("lockstep_router_logits", default=None)
_ROUTING: contextvars.ContextVar[tuple[str, list] | None] = contextvars.ContextVar("lockstep_routing", default=None)


@contextlib.contextmanager
def record_router_logits() -> Iterator[list[Tensor]]:
    """Inside the block, every SparseMoE appends its router logits [T, E] (fp32) to the yielded list,
    layer by layer, for `load_balancing_loss`."""
    found: list[Tensor] = []
    token = _ROUTER_LOGITS.set(found)
    try:
        yield found
    finally:
        _ROUTER_LOGITS.reset(token)


@contextlib.contextmanager
def record_routing() -> Iterator[list[Tensor]]:
    """Inside the block, every SparseMoE appends the experts it chose [T, k] to the yielded list."""
    found: list[Tensor] = []
    token = _ROUTING.set(("record", found))
    try:
        yield found
    finally:
        _ROUTING.reset(token)


@contextlib.contextmanager
def replay_routing(choices: list[Tensor]) -> Iterator[None]:
    """Inside the block, the SparseMoE calls take their experts from `choices` (as `record_routing`
    gave them, call by call) instead of choosing; the weights are still their own router's. The
    float64 chain of docs/contract.md uses it: top-k is a discontinuous choice, so it measures the
    arithmetic of the model under test given the same choices."""
    token = _ROUTING.set(("replay", list(choices)))
    try:
        yield
    finally:
        _ROUTING.reset(token)


def router_probs(logits: Tensor) -> Tensor:
    """The router's probabilities [T, E]: exp(log_softmax) in fp32 (float64 for float64 logits)."""
    return _Exp.apply(ops.log_softmax(logits.to(accumulate_dtype(logits.dtype))))


class _Exp(torch.autograd.Function):
    """e^x: on a CPU by the CPU backend's kernels, float64 included (fixed_order.exp: the native
    backend's own exp, where PyTorch's may take MKL's vector math, whose bits follow the
    instruction set; ADR 0010), else torch.exp. The backward is autograd's for torch.exp,
    grad * e^x."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = exp(x, kernels=cpu_backend_kernel_set())
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return grad * y


class _Normalize(torch.autograd.Function):
    """Router weights [T, k] over their sum, added slot 0 + slot 1 + ... . Backward: with
    y = w / total, dw_i = (g_i - sum_j g_j y_j) / total, the sum in slot order too (autograd's
    would reduce the broadcast total's gradient with an ATen sum, in an order of PyTorch's). The
    backward recomputes total and y from w, so that under create_graph its own derivative is right."""

    @staticmethod
    def forward(ctx, w: Tensor) -> Tensor:
        ctx.save_for_backward(w)
        return _normalize(w)[0]

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (w,) = ctx.saved_tensors
        y, total = _normalize(w)
        return (grad - sum_slots((grad * y)[..., None])) / total[:, None]


def _normalize(w: Tensor) -> tuple[Tensor, Tensor]:
    """(w / total, total) for weights [T, k], total = slot 0 + slot 1 + ... in that order."""
    total = sum_slots(w[..., None])[:, 0]
    return w / total[:, None], total


def route(logits: Tensor, top_k: int, normalize: bool, experts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, k] in logits' dtype, experts [T, k] int64), each row's
    probabilities in fp32 (float64 for float64 logits), each row's
    slots in ascending expert order. Differentiable in the weights. `experts` given: those choices
    ([T, k], ascending per row) instead of the top k."""
    probs = router_probs(logits)
    if experts is None:
        ranked = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
        experts = torch.sort(ranked, dim=-1).values
    weights = probs.gather(1, experts)
    if normalize:
        weights = _Normalize.apply(weights)
    return weights.to(logits.dtype), experts


def sum_slots(y: Tensor) -> Tensor:
    """[T, k, H] -> [T, H] in the accumulation dtype: slot 0 + slot 1 + ... in that order."""
    acc = accumulate_dtype(y.dtype)
    out = y[:, 0].to(acc)
    for j in range(1, y.shape[1]):
        out = out + y[:, j].to(acc)
    return out


class _Dispatch(torch.autograd.Function):
    """x [T, H] -> the rows x[slot // k] of the slots in `order` [T * k]. Backward: each token's k
    slot gradients, put back in slot order and added by `sum_slots`."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x[order // k]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        slots = torch.empty_like(grad)
        slots[order] = grad
        return sum_slots(slots.view(-1, ctx.k, grad.shape[-1])).to(grad.dtype), None, None


class _Undispatch(torch.autograd.Function):
    """Rows in dispatch order [T * k, H] -> slot order [T, k, H] (a permutation: exact both ways)."""

    @staticmethod
    def forward(ctx, rows: Tensor, order: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(order)
        slots = torch.empty_like(rows)
        slots[order] = rows
        return slots.view(-1, k, rows.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        return grad.reshape(-1, grad.shape[-1])[order], None, None


class _Scale(torch.autograd.Function):
    """y [n, H] * w [n] per row; dw by the fixed-order row_sum (a broadcast's autograd sum would not be)."""

    @staticmethod
    def forward(ctx, y: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(y, w)
        return y * w[:, None]

    @staticmethod
    def backward(ctx, grad: Tensor):
        y, w = ctx.saved_tensors
        acc = accumulate_dtype(y.dtype)
        dy = grad * w[:, None] if ctx.needs_input_grad[0] else None
        dw = row_sum(grad.to(acc) * y.to(acc)).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dy, dw


class SparseMoE(nn.Module):
    """Top-k routed experts. `gate`: the router, a linear [E, H] (Hugging Face's `mlp.gate`);
    `experts`: E modules [n, H] -> [n, H] (`mlp.experts.{e}`). x: [T, H] -> [T, H] in x's dtype."""

    def __init__(self, gate: nn.Module, experts: list[nn.Module], top_k: int, normalize: bool):
        super().__init__()
        self.gate = gate
        self.experts = nn.ModuleList(experts)
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: Tensor) -> Tensor:
        logits = self.gate(x)
        recorded = _ROUTER_LOGITS.get()
        if recorded is not None:
            recorded.append(logits.to(accumulate_dtype(logits.dtype)))
        routing = _ROUTING.get()
        given = None
        if routing is not None and routing[0] == "replay":
            if not routing[1]:
                raise RuntimeError("replay_routing: more SparseMoE calls than recorded choices")
            given = routing[1].pop(0).to(x.device)
        weights, experts = route(logits, self.top_k, self.normalize, given)
        if routing is not None and routing[0] == "record":
            routing[1].append(experts)
        return run_experts(x, weights, experts, lambda e, rows: self.experts[e](rows), len(self.experts))


def run_experts(x: Tensor, weights: Tensor, experts: Tensor, expert: Callable[[int, Tensor], Tensor],
                num_experts: int) -> Tensor:
    """The routed experts' weighted outputs, combined: x [T, H]; weights, experts [T, k] (each row's
    experts distinct; `route` gives them ascending); expert(e, rows [n, H]) -> [n, H]. Returns [T, H]
    in x's dtype.

    Rows reach each expert in token order; a token's k outputs are added in slot order in fp32.
    With gradients enabled, every expert runs, on zero rows when none chose it."""
    k = experts.shape[1]
    slot_expert = experts.reshape(-1)
    order = torch.sort(slot_expert, stable=True).indices          # by expert, then token
    counts = torch.bincount(slot_expert, minlength=num_experts).tolist()
    rows = _Dispatch.apply(x, order, k)
    row_weights = weights.reshape(-1)[order]
    every = torch.is_grad_enabled()
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0 and not every:
            continue
        with grad_tree.subset_rows(order[start:start + n] // k):
            y = expert(e, rows[start:start + n])
        outs.append(_Scale.apply(y, row_weights[start:start + n]))
        start += n
    slots = _Undispatch.apply(torch.cat(outs), order, k)
    return sum_slots(slots).to(x.dtype)


def load_balancing_loss(router_logits: list[Tensor], num_experts: int, top_k: int) -> Tensor:
    """The auxiliary load-balancing loss of Switch Transformer with transformers' semantics
    (Qwen3-MoE's `load_balancing_loss_func` without a mask): over all layers' tokens,
    num_experts * sum_e (fraction of slots routed to e) * (mean router probability of e).

    router_logits: one [T, E] tensor per sparse layer. Returns a 0-dim fp32 tensor (float64 for
    float64 logits); the counts are exact and the probability sums run in fixed order (row_sum over
    the tokens)."""
    if not router_logits:
        raise ValueError("router_logits: expected the logits of at least one sparse layer")
    acc = accumulate_dtype(router_logits[0].dtype)
    counts = torch.zeros(num_experts, dtype=acc, device=router_logits[0].device)
    prob_sum = torch.zeros(num_experts, dtype=acc, device=router_logits[0].device)
    rows = 0
    for logits in router_logits:
        probs = router_probs(logits)
        _, chosen = route(logits.detach().to(acc), top_k, False)
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).to(acc)
        prob_sum = prob_sum + row_sum(probs.t().contiguous())
        rows += logits.shape[0]
    return row_sum(counts / rows * (prob_sum / rows)) * num_experts
