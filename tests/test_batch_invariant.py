import threading

import pytest
import torch

import lockstep
from lockstep import mode
from lockstep import contract, ops

from _models import hf_config


def _hf_model(family, dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(family)
    cfg.hidden_size, cfg.intermediate_size = 256, 512
    cfg.head_dim = 32 if family == "qwen3" else 256 // cfg.num_attention_heads
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype).eval()


def _proof(model) -> dict[str, bool]:
    """Alone vs right- and left-padded batches (logits), and generate with KV cache vs one forward (logprobs)."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=gen) for n in (11, 23, 5)]
    alone = [model(s[None]).logits[0] for s in seqs]
    width = max(len(s) for s in seqs)
    result = {}
    for side in ("right", "left"):
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
            ids[i, cols], mask[i, cols] = s, 1
        logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        result[side] = all(torch.equal(logits[i, :len(s)] if side == "right" else logits[i, width - len(s):], alone[i])
                           for i, s in enumerate(seqs))
    prompt = seqs[1][:10][None]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, 10:]
    step_lp = torch.stack([ops.log_softmax(step[0].float())[t] for step, t in zip(out.logits, tokens)])
    full = model(out.sequences).logits[0]
    full_lp = ops.log_softmax(full[9:-1].float()).gather(1, tokens[:, None])[:, 0]
    result["generate"] = torch.equal(step_lp, full_lp)
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_both_ways_make_transformers_invariant(family, dtype):
    model = _hf_model(family, dtype)
    with torch.no_grad():
        stock = _proof(model)
        assert not any(stock.values()), f"stock transformers should show the mismatch: {stock}"
        with lockstep.batch_invariant():
            assert _proof(model) == {"right": True, "left": True, "generate": True}
        lockstep.patch(model)
        try:
            assert _proof(model) == {"right": True, "left": True, "generate": True}
        finally:
            lockstep.unpatch(model)
        assert _proof(model) == stock, "unpatch restores the stock forwards"


def _one_row_differs() -> bool:
    torch.manual_seed(0)
    x, w = torch.randn(64, 1024), torch.randn(1024, 1024) / 32
    return not torch.equal((x[:1] @ w.t())[0], (x @ w.t())[0])


def test_exit_restores_stock_kernels_even_after_an_exception():
    assert _one_row_differs()
    with pytest.raises(ZeroDivisionError):
        with lockstep.batch_invariant():
            assert not _one_row_differs()
            1 / 0
    assert not mode.is_enabled()
    assert _one_row_differs()


def test_nesting_and_enable_disable():
    with lockstep.batch_invariant():
        with lockstep.batch_invariant():
            assert not _one_row_differs()
        assert mode.is_enabled() and not _one_row_differs()
    assert _one_row_differs()
    lockstep.enable()
    try:
        assert not _one_row_differs()
    finally:
        lockstep.disable()
    assert _one_row_differs()


def test_a_second_thread_is_refused_clearly():
    errors = []
    with lockstep.batch_invariant():
        t = threading.Thread(target=lambda: _enter(errors))
        t.start()
        t.join()
    assert errors and "already active in thread" in errors[0]


def _enter(errors):
    try:
        with lockstep.batch_invariant():
            pass
    except RuntimeError as e:
        errors.append(str(e))


def test_strict_raises_on_unsupported_ops():
    assert "aten::var.correction" in mode.unsupported()
    x = torch.randn(4, 8)
    with lockstep.batch_invariant():
        torch.var(x, dim=-1)                         # non-strict: runs stock
    with lockstep.batch_invariant(strict=True):
        with pytest.raises(RuntimeError, match="aten::var.correction has no batch-invariant implementation"):
            torch.var(x, dim=-1)
        torch.softmax(x, -1)                         # covered ops still run
    torch.var(x, dim=-1)


def test_mode_softmax_sum_mean_sdpa_are_invariant_and_close():
    torch.manual_seed(0)
    x = torch.randn(6, 70000)
    q = torch.randn(3, 4, 20, 16)
    k = torch.randn(3, 2, 20, 16)
    with lockstep.batch_invariant():
        for fn in (lambda t: t.sum(-1), lambda t: t.mean(-1), lambda t: torch.softmax(t, -1),
                   lambda t: torch.log_softmax(t, -1)):
            assert torch.equal(fn(x[2:3])[0], fn(x)[2])
        mode_log_softmax = torch.log_softmax(x, -1)
        s = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        d = torch.nn.functional.scaled_dot_product_attention(q[:, :, 7:8], k[:, :, :8], k[:, :, :8], enable_gqa=True)
        assert torch.equal(d[:, :, 0], s[:, :, 7])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(s, ref, atol=1e-5, rtol=1e-5)
    assert contract.tolerance("log_softmax", torch.float32).excess(mode_log_softmax, torch.log_softmax(x, -1)) <= 0


def test_check_mode_prints_coverage(capsys):
    from lockstep import cli

    assert cli.main(["check", "--mode"]) == 0
    out = capsys.readouterr().out
    assert "aten::mm" in out and "aten::scaled_dot_product_attention" in out and "unsupported" in out
    assert "FAIL" not in out
