"""Second derivatives through lockstep's ops (docs/adr/0023): refused with an error that names the
op, except where the backward is exactly differentiable (rope and embedding on the portable and
native backends); the first-order gradients under create_graph keep their bits."""

from __future__ import annotations

import pytest
import torch

from lockstep import contract, ops, registry

T, H, V = 6, 16, 8


def _cases(device: str = "cpu") -> dict:
    """op -> (function of the differentiated inputs, the inputs), fp32, on `device`."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(T, H, generator=gen).to(device), torch.randn(V, H, generator=gen).to(device)
    targets = torch.randint(0, V, (T,), generator=gen).to(device)
    ids = torch.randint(0, V, (T,), generator=gen).to(device)
    cu = torch.tensor([0, T], device=device)
    visible = torch.ones(1, T, T, dtype=torch.bool, device=device).tril()
    heads = (x.view(T, 1, H), w[:T].reshape(T, 1, H), x.view(T, 1, H) * 2)
    return {
        "linear": (lambda x, w: ops.linear(x, w), (x, w)),
        "silu_mul": (ops.silu_mul, (x, x.flip(0))),
        "gelu_mul": (ops.gelu_mul, (x, x.flip(0))),
        "rms_norm": (lambda x, w: ops.rms_norm(x, w, eps=1e-6, offset=1.0), (x, w[0])),
        "log_softmax": (ops.log_softmax, (x,)),
        "cross_entropy": (lambda x: ops.cross_entropy(x, targets), (x,)),
        "selected_logprobs": (lambda h, w: ops.selected_logprobs(h, w, targets, 1.0), (x, w)),
        "attention": (lambda q, k, v: ops.attention(q, k, v, cu, cu, 0.25, True, None), heads),
        "masked_attention": (lambda q, k, v: ops.masked_attention(q, k, v, visible, 0.25)[0],
                             tuple(t.transpose(0, 1)[None] for t in heads)),
        "rope": (lambda x: ops.rope(x, torch.arange(T, device=device)), (x.view(T, 2, H // 2),)),
        "embedding": (lambda w: ops.embedding(ids, w), (w,)),
    }


DIFFERENTIABLE = {("rope", "portable"), ("rope", "native"), ("embedding", "portable"), ("embedding", "native")}
PAIRS = [(op, backend) for backend in ("portable", "native", "triton") for op in _cases()
         if op in contract.backend_ops(backend)]


def _grads(backend: str, op: str, create_graph: bool,
           device: str = "cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The inputs (leaves) and d sum(y^2) / d inputs."""
    fn, inputs = _cases(device)[op]
    leaves = [t.clone().requires_grad_() for t in inputs]
    with registry.use_backend(backend):
        y = fn(*leaves)
        grads = torch.autograd.grad((y * y).sum(), leaves, create_graph=create_graph)
    return leaves, list(grads)


def _assert_refusal(message: str, op: str) -> None:
    assert op in message.split(":")[0].split(" / "), message   # the gated pair shares one Function
    assert "a second derivative through lockstep's" in message and "use_backend('eager')" in message, message


REFUSED = [p for p in PAIRS if p not in DIFFERENTIABLE]


def _check_refusal(op: str, backend: str, device: str) -> None:
    _, plain = _grads(backend, op, create_graph=False, device=device)
    leaves, marked = _grads(backend, op, create_graph=True, device=device)
    for a, b in zip(plain, marked):
        assert torch.equal(a.view(torch.int32), b.detach().view(torch.int32)), "create_graph changed a bit"
    assert all(g.requires_grad for g in marked), "each gradient carries the mark"
    penalty = sum((g * g).sum() for g in marked)
    for differentiate in (lambda: torch.autograd.grad(penalty, leaves, retain_graph=True),
                          lambda: (penalty + sum(t.sum() for t in leaves)).backward()):
        with registry.use_backend(backend), pytest.raises(RuntimeError) as refused:
            differentiate()
        _assert_refusal(str(refused.value), op)


@pytest.mark.parametrize("op, backend", REFUSED, ids=lambda p: str(p))
def test_a_second_derivative_is_refused_with_the_ops_name(op, backend):
    _check_refusal(op, backend, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op", [op for op, backend in REFUSED if backend == "triton"])
def test_a_second_derivative_through_compiled_triton_kernels_is_refused_on_cuda(op):
    """The same refusal and first-order bits with the Triton kernels compiled, on CUDA tensors."""
    _check_refusal(op, "triton", "cuda")


@pytest.mark.parametrize("op, backend", REFUSED, ids=lambda p: str(p))
def test_the_refusal_holds_when_the_ops_output_is_the_loss(op, backend):
    """d y.sum() / d inputs: the incoming gradient is a constant, so for an op whose saved tensors
    need no gradient (cross entropy) nothing could carry a mark, and create_graph raises at once."""
    fn, inputs = _cases()[op]
    leaves = [t.clone().requires_grad_() for t in inputs]
    with registry.use_backend(backend), pytest.raises(RuntimeError) as refused:
        grads = torch.autograd.grad(fn(*leaves).sum(), leaves, create_graph=True)
        torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)
    _assert_refusal(str(refused.value), op)


@pytest.mark.parametrize("backend", ["portable", "native"])
def test_create_graph_under_a_non_reentrant_checkpoint_keeps_the_first_order_bits(backend):
    """A non-reentrant checkpoint lets a backward unpack its saved tensors once: the mark reuses
    what the backward unpacked."""
    from torch.utils.checkpoint import checkpoint

    fn, inputs = _cases()["rms_norm"]
    got = []
    for create_graph in (False, True):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with registry.use_backend(backend):
            y = checkpoint(fn, *leaves, use_reentrant=False)
            grads = torch.autograd.grad((y * y).sum(), leaves, create_graph=create_graph)
        got.append([g.detach() for g in grads])
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(*got))


@pytest.mark.parametrize("op, backend", sorted(DIFFERENTIABLE), ids=lambda p: str(p))
def test_rope_and_embedding_give_second_derivatives_within_the_contract(op, backend):
    """Their backward is linear in the incoming gradient and recorded by PyTorch's autograd: the
    second derivative is the float64 eager one within the contract's fp32 gradient tolerance."""
    def second(backend: str, dtype: torch.dtype) -> list[torch.Tensor]:
        fn, inputs = _cases()[op]
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        with registry.use_backend(backend):
            y = fn(*leaves)
            grads = torch.autograd.grad((y * y).sum(), leaves, create_graph=True)
            return list(torch.autograd.grad(sum((g * g).sum() for g in grads), leaves))

    tol = contract.tolerance(op, torch.float32, "gradient")
    for got, ref in zip(second(backend, torch.float32), second("eager", torch.float64)):
        assert ref.abs().max() > 0 and tol.excess(got, ref) <= 0, op
