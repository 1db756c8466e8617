"""lockstep's ops under torch.autocast follow autocast's casts, and stay invariant."""

import pytest
import torch

import lockstep
from lockstep import ops
from lockstep.model import ModelConfig, Transformer

CPU_BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def test_ops_cast_like_the_aten_ops_they_stand_for():
    x, w, b = torch.randn(5, 16), torch.randn(8, 16), torch.randn(8)
    with torch.autocast(**CPU_BF16):
        stock = torch.nn.functional.linear(x, w, b)
        ours = ops.linear(x, w, b)
        assert ours.dtype == stock.dtype == torch.bfloat16
        logits = torch.randn(5, 8, dtype=torch.bfloat16)
        t = torch.randint(0, 8, (5,))
        assert ops.cross_entropy(logits, t).dtype == torch.nn.functional.cross_entropy(logits, t).dtype == torch.float32
        assert ops.log_softmax(logits).dtype == torch.log_softmax(logits, -1).dtype == torch.bfloat16
        # a bf16 activation and an fp32 weight: the wider dtype, as type promotion would give
        assert ops.rms_norm(stock, torch.ones(8)).dtype == torch.float32
        assert ops.silu_mul(stock, torch.randn(5, 8)).dtype == torch.float32
        q = torch.randn(6, 2, 16)
        cu = torch.tensor([0, 6])
        assert ops.attention(q, q, q, cu, cu).dtype == torch.bfloat16
    # The autocast result is the bf16 computation itself, bit for bit.
    assert torch.equal(ours, ops.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()))
    assert ops.linear(x, w, b).dtype == torch.float32, "outside autocast nothing is cast"
    with pytest.raises(TypeError, match="weight: expected dtype torch.float32"):
        ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16))     # mixed dtypes stay an error outside autocast


def test_a_model_under_autocast_is_invariant_and_trains_its_fp32_weights():
    model = Transformer.from_config(ModelConfig.tiny("qwen3"), seed=0)           # fp32 weights
    seqs = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 20, 4)]
    with torch.autocast(**CPU_BF16):
        alone = [lockstep.logprobs(model, [s])[0] for s in seqs]
        batched = lockstep.logprobs(model, seqs)
        loss = -sum(lp.sum() for lp in batched)
    assert all(torch.equal(a, b) for a, b in zip(alone, batched))
    plain = lockstep.logprobs(model, seqs)
    assert not all(torch.equal(a, b) for a, b in zip(plain, batched)), "autocast changed nothing"
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_the_mode_follows_autocast_and_stays_invariant():
    x, w = torch.randn(40, 64), torch.randn(32, 64)
    with torch.autocast(**CPU_BF16), lockstep.batch_invariant():
        full = torch.nn.functional.linear(x, w)
        one = torch.nn.functional.linear(x[3:4], w)
    assert full.dtype == torch.bfloat16 and torch.equal(one[0], full[3])
