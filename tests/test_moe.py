"""The mixture-of-experts layer (lockstep.model.moe): routing, its tie order, the combine order,
the auxiliary loss against transformers, and checkpoints with fused experts."""

import pytest
import torch

from lockstep import contract
from lockstep.model import ModelConfig, Transformer, load_model, logprobs
from lockstep.model import moe
from lockstep.model.moe import load_balancing_loss, record_routing, replay_routing, route


def _moe(dtype=torch.float32):
    model = Transformer.from_config(ModelConfig.tiny("qwen3_moe", mlp_only_layers=()), seed=4, dtype=dtype)
    return model.model.layers[0].mlp


def test_route_breaks_ties_toward_the_lower_expert_and_orders_slots():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, experts = route(logits, 2, normalize=False)
    assert experts.tolist() == [[1, 2], [0, 1]]
    tol = contract.tolerance("log_softmax", torch.float32)           # the router's probabilities
    assert weights[1, 0] == weights[1, 1]
    torch.testing.assert_close(weights[1].double(), torch.full((2,), 0.2, dtype=torch.float64), atol=tol.atol,
                               rtol=tol.rtol)
    normalized, _ = route(logits, 2, normalize=True)
    torch.testing.assert_close(normalized.sum(-1).double(), torch.ones(2, dtype=torch.float64), atol=tol.atol,
                               rtol=tol.rtol)


def test_router_probabilities_take_the_cpu_backends_exp():
    """The router's exp is the native kernels', the same on every CPU: PyTorch's fp32 exp may take
    MKL's vector math, whose bits follow the instruction set (ADR 0010). tests/test_native_bits.py digests
    the router under each kernel selection."""
    from lockstep.numerics import fixed_order
    from lockstep import ops
    from lockstep.model.moe import router_probs
    from lockstep.registry import cpu_backend, cpu_backend_kernel_set

    logits = torch.rand(64, 16, generator=torch.Generator().manual_seed(2)) * 16 - 8
    want = fixed_order.exp(ops.log_softmax(logits), kernels=cpu_backend_kernel_set())
    assert cpu_backend() == "native" and torch.equal(router_probs(logits), want)


def test_renormalised_weights_have_the_gradient_of_w_over_their_sum():
    """The slot-order backward of the renormalisation (moe._Normalize) against autograd's own in
    float64, and its bits do not depend on the other rows."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(9, 8, dtype=torch.float64, generator=gen)
    weights, experts = route(logits, 8, normalize=True)
    (got,) = torch.autograd.grad(weights, logits, g)
    raw, _ = route(logits, 8, normalize=False, experts=experts)
    (want,) = torch.autograd.grad(raw / raw.sum(-1, keepdim=True), logits, g)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    x = logits.detach().float().requires_grad_()
    w, _ = route(x, 8, normalize=True)
    (row,) = torch.autograd.grad(route(x[4:5], 8, normalize=True)[0], x, g[4:5].float())
    (full,) = torch.autograd.grad(w, x, torch.zeros(9, 8).index_copy(0, torch.tensor([4]), g[4:5].float()))
    assert torch.equal(row[4], full[4])
    normalize = moe._Normalize.apply
    w = torch.rand(5, 4, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradgradcheck(normalize, (w,))            # its derivative under create_graph too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_token_does_not_see_how_many_others_chose_its_experts(dtype):
    moe = _moe(dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=gen).to(dtype)
    perm = torch.randperm(40, generator=gen)
    with torch.no_grad():
        alone = moe(x[:1])
        crowd = moe(torch.cat([x[:1].expand(30, 64), x[1:]]))           # 30 copies share its experts
        batch = moe(x)
        shuffled = moe(x[perm])
    assert all(torch.equal(crowd[i], alone[0]) for i in range(30))
    assert torch.equal(batch[0], alone[0]) and torch.equal(shuffled[torch.argsort(perm)], batch)


def test_input_and_router_gradients_are_those_of_a_token_alone():
    moe = _moe()
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))

    def grads(rows):
        moe.zero_grad()
        t = rows.clone().requires_grad_()
        moe(t)[0].sum().backward()
        return t.grad[0], moe.gate.weight.grad.clone()

    dx_alone, dgate_alone = grads(x[:1])
    dx_batch, dgate_batch = grads(x)
    assert torch.equal(dx_alone, dx_batch) and torch.equal(dgate_alone, dgate_batch)


def test_load_balancing_loss_has_transformers_semantics():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    gen = torch.Generator().manual_seed(2)
    layers = [torch.randn(37, 8, generator=gen) for _ in range(3)]
    ours = load_balancing_loss(layers, 8, 2)
    theirs = load_balancing_loss_func(tuple(layers), 8, 2)
    tol = contract.tolerance("log_softmax", torch.float32)
    torch.testing.assert_close(ours.double(), theirs.double(), atol=tol.atol, rtol=tol.rtol)
    with pytest.raises(ValueError, match="router_logits: expected the logits of at least one sparse layer"):
        load_balancing_loss([], 8, 2)


def test_replayed_routing_pins_the_experts_and_refuses_extra_calls():
    model = Transformer.from_config(ModelConfig.tiny("qwen3_moe"), seed=0)
    seqs = [torch.arange(1, 30), torch.arange(5, 17)]
    with torch.no_grad(), record_routing() as chosen:
        want = logprobs(model, seqs)
    assert len(chosen) == 1 and chosen[0].shape == (41, 2)
    with torch.no_grad(), replay_routing(chosen):
        got = logprobs(model, seqs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad(), replay_routing([]), pytest.raises(RuntimeError, match="more SparseMoE calls than recorded"):
        logprobs(model, seqs)


def test_a_checkpoint_with_fused_experts_loads_as_the_hub_layout(tmp_path):
    from safetensors.torch import load_file, save_file

    model = Transformer.from_config(ModelConfig.tiny("qwen3_moe", vocab_size=300), seed=5)
    model.save(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    prefix = "model.layers.1.mlp.experts."
    gate_up = torch.stack([torch.cat([tensors.pop(f"{prefix}{e}.gate_proj.weight"),
                                      tensors.pop(f"{prefix}{e}.up_proj.weight")]) for e in range(8)])
    down = torch.stack([tensors.pop(f"{prefix}{e}.down_proj.weight") for e in range(8)])
    save_file({**tensors, f"{prefix}gate_up_proj": gate_up, f"{prefix}down_proj": down},
              str(tmp_path / "model.safetensors"))
    again = load_model(str(tmp_path), dtype=torch.float32)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok: expected at most num_experts=8, got 9"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size: expected a positive int for a mixture of experts"),
])
def test_moe_config_out_of_range(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny("qwen3_moe", **change)
