"""The mode's Triton route, the kernels CUDA tensors take (docs/adr/0039), run here on CPU tensors
under Triton's interpreter: `lockstep.mode.routes.route` pointed at it. Its bits are those of the
Triton backend's own ops where the two compute the same thing, and a model under it is batch
invariant. The CUDA dispatch keys themselves are tested in test_gpu.py."""

import pytest
import torch

import lockstep
from lockstep import ops
from lockstep.mode import attention, routes

from _models import COMMON


@pytest.fixture
def triton_route(monkeypatch):
    route = routes.triton_route()
    monkeypatch.setattr(routes, "route", lambda device: route)
    return route


def test_cuda_tensors_take_the_triton_route_and_cpu_tensors_the_cpu_route():
    assert routes.route(torch.device("cuda")) is routes.triton_route()
    assert routes.route(torch.device("cpu")) is routes.CPU
    assert set(routes.triton_route().overrides) == set(routes.CPU.overrides) == routes.names()
    # The ops the Triton route runs on its own kernels; the rest are the CPU route's.
    own = {n for n, fn in routes.triton_route().overrides.items() if fn is not routes.CPU.overrides[n]}
    assert {"mm", "addmm", "bmm", "_log_softmax", "_softmax", "_fused_rms_norm", "_fused_rms_norm_backward",
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention"} <= own
    assert "sum.dim_IntList" not in own and "silu" not in own


_GEN = torch.Generator().manual_seed(5)
_A, _W = torch.randn(40, 48, generator=_GEN), torch.randn(48, 24, generator=_GEN) / 7
_B = torch.randn(24, generator=_GEN)
GEMM_FORMS = {
    "mm": lambda a: a @ _W,
    "addmm": lambda a: torch.addmm(_B, a, _W),
    "bmm": lambda a: torch.bmm(a[None], _W[None])[0],
    "baddbmm": lambda a: torch.baddbmm(_B.expand(1, a.shape[0], 24), a[None], _W[None])[0],
    "addbmm": lambda a: torch.addbmm(_B, torch.stack([a, a]), torch.stack([_W, _W])),
    "mv": lambda a: a @ _W[:, 0],
    "linear 3-D strided": lambda a: torch.nn.functional.linear(torch.stack([a, a], 1), _W.t(), _B)[:, 0],
}


def test_every_gemm_form_is_row_invariant_on_the_triton_route(triton_route):
    with lockstep.batch_invariant():
        for name, fn in GEMM_FORMS.items():
            full = fn(_A)
            assert torch.equal(fn(_A[7:8])[0], full[7]), name
            assert torch.equal(fn(_A[:5]), full[:5]), name
        assert torch.equal(torch.dot(_A[7], _W[:, 0]), (_A @ _W[:, 0])[7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_route_gives_the_triton_ops_bits(triton_route, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 48, generator=gen).to(dtype)
    w = (torch.randn(40, 48, generator=gen) / 7).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(48, generator=gen)).to(dtype)
    g = torch.randn(20, 40, generator=gen).to(dtype)
    q, k = torch.randn(1, 2, 18, 16, generator=gen).to(dtype), torch.randn(1, 1, 18, 16, generator=gen).to(dtype)
    visible = torch.ones(1, 18, 18, dtype=torch.bool).tril()

    def run(linear, log_softmax, rms_norm, sdpa):
        xs, ws, qs, ks = (t.clone().requires_grad_() for t in (x, w, q, k))
        y = log_softmax(linear(xs, ws))
        y.backward(g)
        n, dn, dnw = rms_norm(x, norm_w)
        a = sdpa(qs, ks)
        a.backward(q)
        return [y, xs.grad, ws.grad, n, dn, dnw, a, qs.grad, ks.grad]

    def fused_rms_norm(t, nw):
        # Its backward is called as autograd calls it: this torch build has no CPU kernel of
        # aten::_fused_rms_norm_backward for the mode to go over.
        y, rstd = torch.ops.aten._fused_rms_norm(t, [48], nw, 1e-6)
        dx, dw = triton_route.overrides["_fused_rms_norm_backward"](x, t, [48], rstd, nw, [True, True])
        return y, dx, dw

    def triton_rms_norm(t, nw):
        ts, nws = t.clone().requires_grad_(), nw.clone().requires_grad_()
        y = ops.rms_norm(ts, nws, 1e-6)
        y.backward(x)
        return y, ts.grad, nws.grad

    with lockstep.batch_invariant():
        mode = run(torch.nn.functional.linear, lambda t: torch.log_softmax(t, -1), fused_rms_norm,
                   lambda a, b: torch.nn.functional.scaled_dot_product_attention(a, b, b, is_causal=True,
                                                                                 enable_gqa=True))
    with lockstep.use_backend("triton"):
        own = run(ops.linear, ops.log_softmax, triton_rms_norm,
                  lambda a, b: ops.masked_attention(a, b, b, visible)[0])
    names = ["log_softmax(linear)", "dx", "dw", "rms_norm", "rms_norm dx", "rms_norm dw", "sdpa", "dq", "dk"]
    # In bf16 the mode's log_softmax backward sees only its rounded output, the op its fp32 input:
    # the same arithmetic on other inputs, so those two gradients are not the op's and are left out
    # here (the mode's gradients are held batch invariant below).
    rounded = {"dx", "dw"} if dtype == torch.bfloat16 else set()
    for name, a, b in zip(names, mode, own):
        assert a.dtype == b.dtype, name
        if name not in rounded:
            assert torch.equal(a, b), name
    if dtype == torch.float32:
        # The CPU route's GEMM (the native kernels) sums in another order: the bits above are Triton's.
        assert not torch.equal(routes.CPU.overrides["mm"](x, w.t()), _triton_linear(x, w))
        with lockstep.batch_invariant():
            soft = torch.softmax(x, -1)
        with lockstep.use_backend("triton"):
            assert torch.equal(soft, torch.exp(ops.log_softmax(x)))


def _triton_linear(x, w):
    with lockstep.use_backend("triton"):
        return ops.linear(x, w)


def _tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**COMMON, "hidden_size": 32, "intermediate_size": 48, "vocab_size": 96,
                         "num_hidden_layers": 1})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def test_a_small_model_on_the_triton_route_is_batch_invariant(triton_route):
    """Each sequence alone vs in a right- and a left-padded batch: the logits, and the gradient of
    each sequence's logits with respect to its input embeddings (GEMMs, SDPA and their backward)."""
    model = _tiny_llama()
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 96, (n,), generator=gen) for n in (7, 3)]
    width = max(len(s) for s in seqs)
    embed = model.get_input_embeddings()

    def run(ids, mask=None):
        x = embed(ids).detach().requires_grad_()
        pos = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(inputs_embeds=x, attention_mask=mask, position_ids=pos).logits
        keep = torch.ones_like(logits) if mask is None else mask[..., None].to(logits.dtype)
        (logits * keep).sum().backward()
        return logits.detach(), x.grad

    with lockstep.batch_invariant():
        alone = [run(s[None]) for s in seqs]
        for side in ("right", "left"):
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
                ids[i, cols], mask[i, cols] = s, 1
            logits, grad = run(ids, mask)
            for i, s in enumerate(seqs):
                cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
                assert torch.equal(logits[i, cols], alone[i][0][0]), (side, i)
                assert torch.equal(grad[i, cols], alone[i][1][0]), (side, i)


def test_cuda_sdpa_forms_run_masked_attention_on_the_route():
    """The kernels of SDPA's CUDA forms (flash, memory-efficient, cuDNN, math) and their backward,
    called on CPU tensors: each gives ops.masked_attention's output and gradients on Triton."""
    kernels, math = attention.overrides("triton"), attention.math_override("triton")
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, h, 12, 16, generator=gen) for h in (4, 2, 2, 4))
    causal = torch.ones(2, 12, 12, dtype=torch.bool).tril()
    pad = causal.clone()
    pad[1, :, :3] = False
    bias = torch.zeros(2, 1, 12, 12).masked_fill(~pad[:, None], float("-inf")).expand(2, 4, 12, 12)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    with lockstep.use_backend("triton"):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        want, want_lse = ops.masked_attention(qs, ks, vs, causal)
        want.backward(do)
        qp, kp, vp = (t.clone().requires_grad_() for t in (q, kk, vv))
        want_pad, _ = ops.masked_attention(qp, kp, vp, pad)
        want_pad.backward(do)
    scale = 0.25

    flash = kernels["_scaled_dot_product_flash_attention"](q, k, v, 0.0, True, False, scale=scale)
    assert torch.equal(flash[0], want) and torch.equal(flash[1], want_lse) and flash[4:6] == (12, 12)
    grads = kernels["_scaled_dot_product_flash_attention_backward"](do, q, k, v, *flash[:6], 0.0, True, flash[6],
                                                                     flash[7], scale=scale)
    assert all(torch.equal(a, b) for a, b in zip(grads, (qs.grad, ks.grad, vs.grad)))

    eff = kernels["_scaled_dot_product_efficient_attention"](q, kk, vv, bias, True, 0.0, False, scale=scale)
    assert torch.equal(eff[0], want_pad)
    grads = kernels["_scaled_dot_product_efficient_attention_backward"](do, q, kk, vv, bias, eff[0], eff[1], eff[2],
                                                                         eff[3], 0.0, [True, True, True, False],
                                                                         False, scale=scale)
    assert all(torch.equal(a, b) for a, b in zip(grads[:3], (qp.grad, kp.grad, vp.grad)))
    with pytest.raises(NotImplementedError, match="attn_bias: expected a mask that needs no gradient"):
        kernels["_scaled_dot_product_efficient_attention_backward"](do, q, kk, vv, bias, eff[0], eff[1], eff[2],
                                                                    eff[3], 0.0, [True, True, True, True], False)

    cudnn = kernels["_scaled_dot_product_cudnn_attention"](q, kk, vv, pad[:, None], False, 0.0, False, scale=scale)
    assert torch.equal(cudnn[0], want_pad)
    grads = kernels["_scaled_dot_product_cudnn_attention_backward"](do, q, kk, vv, cudnn[0], cudnn[1], cudnn[6],
                                                                     cudnn[7], pad[:, None], *cudnn[2:6], 0.0, False,
                                                                     scale=scale)
    assert all(torch.equal(a, b) for a, b in zip(grads, (qp.grad, kp.grad, vp.grad)))

    qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
    out, weights = math(qm, km, vm, None, 0.0, True, scale=scale, enable_gqa=True)
    out.backward(do)
    assert torch.equal(out, want) and weights.numel() == 0
    assert all(torch.equal(a, b) for a, b in zip((qm.grad, km.grad, vm.grad), (qs.grad, ks.grad, vs.grad)))
    assert kernels["_scaled_dot_product_flash_attention"](q, k, v, 0.1, True) is None     # dropout runs stock


def test_sdpa_masks_the_mode_cannot_take_are_refused_by_name():
    q = torch.randn(1, 2, 4, 8)
    heads_differ = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    heads_differ[0, 1, 0, 1:] = False
    with pytest.raises(NotImplementedError, match="attn_mask: expected one mask for all heads"):
        attention.visible_mask(q, q, heads_differ, False)
    with pytest.raises(NotImplementedError, match="attn_mask: expected a bool mask or a float mask of only 0 and -inf"):
        attention.visible_mask(q, q, torch.full((1, 1, 4, 4), 0.5), False)


def test_the_math_form_at_the_autograd_key_runs_masked_attention(triton_route):
    """The mode's kernel for the composite `_scaled_dot_product_attention_math`, registered at an
    autograd key as enable() does on CUDA (here AutogradCPU, for the test): SDPA forced to its
    math form gives the Triton op's output and gradients, and the stock form is back afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from lockstep.mode import dispatch

    name = "_scaled_dot_product_attention_math"
    lib = torch.library.Library("aten", "IMPL")
    lib.impl(name, dispatch._make_autograd(name, torch.library.get_kernel(f"aten::{name}", "AutogradCPU")),
             "AutogradCPU", with_keyset=True, **dispatch._OVER_OTHERS)
    gen = torch.Generator().manual_seed(6)
    q0, k0 = torch.randn(2, 4, 10, 16, generator=gen), torch.randn(2, 2, 10, 16, generator=gen)
    try:
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        out.sum().backward()
    finally:
        lib._destroy()
    qs, ks = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    with lockstep.use_backend("triton"):
        want, _ = ops.masked_attention(qs, ks, ks, torch.ones(2, 10, 10, dtype=torch.bool).tril())
    want.sum().backward()
    assert torch.equal(out, want) and torch.equal(q.grad, qs.grad) and torch.equal(k.grad, ks.grad)
    with sdpa_kernel(SDPBackend.MATH):
        stock = torch.nn.functional.scaled_dot_product_attention(q0, k0, k0, is_causal=True, enable_gqa=True)
    assert not torch.equal(stock, want)
