"""The native exp, log and sqrt (exp_log.c, unary.py): the same bits on every instruction set, their
accuracy, the IEEE root, and their gradients where autograd records."""

from __future__ import annotations

import math
import platform

import pytest
import torch

from lockstep import ops
from lockstep.numerics import fixed_order
from lockstep.numerics.softcap import softcap
from lockstep.backends.native import build, unary
from lockstep.backends.native.cpu import KERNELS
from lockstep.model import ModelConfig, Transformer

from _native_helpers import isa  # noqa: F401  (fixtures)


def test_exp_and_log_bits_across_instruction_sets_and_their_accuracy(isa):
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(50_001, generator=gen) * 30, torch.linspace(-110, 95, 20_003),
                   torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 88.72, 88.73, -103.9, -104.1, float("inf"),
                                 float("-inf"), float("nan")])])
    pos = torch.cat([torch.rand(50_001, generator=gen) * 1e3, torch.tensor([1e-45, 1e-40, 1.17549435e-38, 1.0,
                                                                            2.0 ** 0.5, 3e38])])
    results = []
    for name in build.supported_isas():
        isa(name)
        results.append((unary.exp(x), unary.log(pos), unary.log(x)))
    for other in results[1:]:
        for u, v in zip(results[0], other):
            assert torch.equal(u.view(torch.int32), v.view(torch.int32))
    e, lg, lgx = results[0]
    ref_e, ref_l = torch.exp(x.double()), torch.log(pos.double())
    normal = (ref_e > 1.2e-38) & (ref_e < 3.4e38)  # fp32's normal range: 2 ulp = 2.4e-7 relative
    assert ((e.double() - ref_e).abs() <= 2.4e-7 * ref_e.abs())[normal].all()
    assert torch.equal(torch.isinf(e), torch.isinf(ref_e.float())) and torch.isnan(e[-1])
    assert ((lg.double() - ref_l).abs() <= 2.4e-7 * ref_l.abs().clamp_min(1.0)).all()
    assert lgx[x < 0].isnan().all() and (lgx[x == 0] == float("-inf")).all() and lgx[-3] == float("inf")


def test_sqrt_is_the_ieee_root_in_every_instruction_set(monkeypatch):
    """The native sqrt (AdamW's denominator) is the correctly rounded root, bit for bit, in every
    path this CPU runs, tails and the special values included; bf16 in is widened exactly; `out`
    takes it in place, strided, as x itself or as a shifted view of x."""
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.exp(torch.rand(100_003, generator=gen, dtype=torch.float64) * 180 - 100).float(),
                   torch.tensor([0.0, -0.0, 1e-45, 1e-40, 3.4e38, 1.0, 2.0, float("inf"), -1.0, float("nan")])])

    def ieee(t: torch.Tensor) -> torch.Tensor:
        """float64's correctly rounded root, rounded to fp32: the fp32 root (53 >= 2 x 24 + 2 bits)."""
        return torch.tensor([math.sqrt(v) if v >= 0 else float("nan") for v in t.tolist()]).float()

    want, xb = ieee(x), x[:1000].bfloat16()
    if platform.machine() == "x86_64":                              # CI's: scalar, AVX2 and more
        assert {"scalar", "avx2"} <= set(build.supported_isas()), build.supported_isas()
    for name in build.supported_isas():
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", name)
        got = unary.sqrt(x)
        assert torch.equal(got.view(torch.int32)[:-2], want.view(torch.int32)[:-2]), name
        assert got[-2:].isnan().all() and str(got[-9].item()) == "-0.0", name
        assert torch.equal(unary.sqrt(xb), ieee(xb.float()).bfloat16()), name
    got = unary.sqrt(x)
    out = torch.empty_like(x)
    assert unary.sqrt(x, out=out) is out and torch.equal(out.view(torch.int32), got.view(torch.int32))
    strided = torch.empty(x.numel(), 2)[:, 0]                       # AdamW's buffer for a transposed weight
    assert unary.sqrt(x, out=strided) is strided and torch.equal(strided.view(torch.int32), got.view(torch.int32))
    same = x.clone()
    assert unary.sqrt(same, out=same) is same and torch.equal(same.view(torch.int32), got.view(torch.int32))
    shifted = torch.cat([x, torch.zeros(1)])
    unary.sqrt(shifted[:-1], out=shifted[1:])
    assert torch.equal(shifted[1:].view(torch.int32), got.view(torch.int32))
    with pytest.raises(ValueError, match=r"out: expected a float32 CPU tensor of shape \(5,\), got "
                                         r"torch.bfloat16 on cpu of shape \(5,\)"):
        unary.sqrt(torch.ones(5), out=torch.empty(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out: expected a float64 CPU tensor of shape \(5,\), got "
                                         r"torch.float32 on cpu of shape \(5,\)"):
        unary.sqrt(torch.ones(5, dtype=torch.float64), out=torch.empty(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_exp_log_and_roots_on_the_kernels_are_differentiable_as_torchs(dtype):
    """fixed_order's exp, log, sqrt and rsqrt on the native kernels, called where autograd records
    (softcap's tanh on a softcapped LM head), give torch's formulas' gradients on their own values;
    where autograd does not record, the kernels' result carries no graph."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.rand(1000, generator=gen, dtype=torch.float64) * 4 + 0.1).to(dtype).requires_grad_(True)
    g = torch.randn(1000, generator=gen, dtype=torch.float64).to(dtype)
    for fn, dydx in ((fixed_order.exp, lambda y: g * y), (fixed_order.log, lambda y: g / x.detach()),
                     (fixed_order.sqrt, lambda y: g / (2 * y))):
        y = fn(x, kernels=KERNELS)
        assert torch.equal(y.detach(), getattr(unary, fn.__name__)(x.detach()))
        (dx,) = torch.autograd.grad(y, x, g)
        assert torch.equal(dx, dydx(y.detach())), fn.__name__
    y = fixed_order.rsqrt(x, kernels=KERNELS)
    (dx,) = torch.autograd.grad(y, x, g)
    root = unary.sqrt(x.detach())
    r = 1 / root
    assert torch.equal(y.detach(), r) and torch.equal(dx, (-g * (r * r)) / (2 * root))
    assert type(fixed_order.exp(x, kernels=KERNELS).grad_fn).__name__ == "_OnKernelsBackward"
    assert fixed_order.exp(x.detach(), kernels=KERNELS).grad_fn is None
    with pytest.raises(RuntimeError, match="out: sqrt into out= does not support automatic differentiation"):
        fixed_order.sqrt(x, out=torch.empty_like(x.detach()), kernels=KERNELS)


def test_softcapped_logits_on_the_kernels_keep_their_gradient():
    """Transformer.logits softcaps through fixed_order.exp on the CPU backend's kernels (the native
    ones here), as the LM head's ops do: its gradient reaches every weight, finite and nonzero, and
    the same bits twice (before ADR 0027 the backward raised: the capped logits carried no graph).
    The formulas' bits are test_exp_log_and_roots_on_the_kernels_are_differentiable_as_torchs'."""
    model = Transformer.from_config(ModelConfig.tiny("gemma3_text", vocab_size=300, final_logit_softcapping=30.0),
                                    seed=0)
    ids, cu = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(0)), torch.tensor([0, 12])
    with torch.no_grad():
        logits = ops.linear(model(ids, cu), model.lm_head_weight)
        on_kernels, _ = softcap(logits.to(fixed_order.accumulate_dtype(logits.dtype)),
                                model.config.final_logit_softcapping, kernels=KERNELS)
        assert torch.equal(model.logits(ids, cu), on_kernels.to(logits.dtype))
    grads = []
    for _ in range(2):
        model.zero_grad()
        model.logits(ids, cu).square().sum().backward()
        assert all(p.grad is not None and p.grad.isfinite().all() and p.grad.abs().max() > 0
                   for p in model.parameters())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])
