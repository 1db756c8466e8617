import math
import os
from fractions import Fraction

import pytest
import torch

from lockstep import contract, train
from lockstep.numerics import exact_math
from lockstep.model import ModelConfig, Transformer, packed_logprobs
from lockstep.train import AdamW, AdamWConfig, PackedDataset, PolicyLoss, TrainConfig, Trainer


def _tokens(n=6000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (n,), generator=gen).tolist()


def _trainer(seed=0, dtype=torch.float32, layout_invariant=True, family="qwen3", device="cpu", **kw):
    cfg = TrainConfig(**{**dict(steps=12, seq_len=32, micro_batch_tokens=96, accum=2, lr=3e-3, warmup=3, seed=seed), **kw})
    model = Transformer.from_config(ModelConfig.tiny(family, vocab_size=300), seed=seed, dtype=dtype).to(device)
    return Trainer(model, PackedDataset(_tokens(), cfg.seq_len, cfg.micro_batch_tokens, cfg.seed), cfg,
                   layout_invariant=layout_invariant)


def _run(t, steps):
    return [t.step() for _ in range(steps)]


def test_replay_is_bitwise():
    a, b = _trainer(), _trainer()
    ra, rb = _run(a, 6), _run(b, 6)
    assert [(r["loss"], r["grad_norm"]) for r in ra] == [(r["loss"], r["grad_norm"]) for r in rb]
    assert a.params_digest() == b.params_digest()
    assert a.opt.step_count == 6, "one optimizer step per accumulation window"


@pytest.mark.parametrize("dtype, master", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-master"])
def test_resume_continues_bitwise(tmp_path, dtype, master):
    full = _trainer(dtype=dtype, master_weights=master)
    losses_full = [r["loss"] for r in _run(full, 8)]
    first = _trainer(dtype=dtype, master_weights=master)
    _run(first, 5)
    first.save(str(tmp_path))
    resumed = _trainer(dtype=dtype, master_weights=master)
    assert resumed.resume(str(tmp_path)) == 5
    losses_resumed = [r["loss"] for r in _run(resumed, 3)]
    assert losses_resumed == losses_full[5:]
    assert resumed.params_digest() == full.params_digest()


def test_padding_changes_no_bit_of_the_update():
    """Masked tokens after a sequence's end, and a masked sequence at the end of the window."""
    a, b = _trainer(), _trainer()
    window = a.window()
    b.window()
    padded = [torch.cat([s, torch.zeros(5, dtype=torch.long)]) for s in window] + [torch.zeros(37, dtype=torch.long)]
    masks = [torch.cat([torch.ones(s.numel() - 1, dtype=torch.bool), torch.zeros(5, dtype=torch.bool)]) for s in window]
    masks.append(torch.zeros(36, dtype=torch.bool))
    ra = a.step(window)
    rb = b.step(padded, masks)
    assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"]
    assert a.params_digest() == b.params_digest()


def test_window_gradients_do_not_depend_on_the_micro_batches():
    """The window's gradients (of the token-mean over the whole window) and loss are bitwise the same
    for micro-batches of any size, including micro-batches of unequal length."""
    a, b = _trainer(accum=2), _trainer(accum=1, micro_batch_tokens=1000)
    window = a.window()
    window = [s[:20] if i >= 2 else s for i, s in enumerate(window)]
    la, na = a.accumulate(window)
    lb, nb = b.accumulate(window)
    assert (la, na) == (lb, nb)
    assert a.grads.keys() == b.grads.keys() == {n for n, _ in a.named}
    for n in a.grads:
        assert torch.equal(a.grads[n], b.grads[n]), n


def test_the_order_before_unit_trees_depends_on_the_micro_batches():
    """What the unit trees fix: autograd's sum over micro-batches changes bits with their size."""
    a = _trainer(accum=2, layout_invariant=False)
    b = _trainer(accum=1, micro_batch_tokens=1000, layout_invariant=False)
    window = a.window()
    a.accumulate(window)
    b.accumulate(window)
    assert any(not torch.equal(a.grads[n], b.grads[n]) for n in a.grads)


def test_parity_with_plain_pytorch_trainer_50_steps():
    """torch.optim.AdamW + F.cross_entropy + transformers' Llama, against lockstep's trainer, fp32."""
    from lockstep.parity import PlainTrainer

    cfg = TrainConfig(steps=50, seq_len=24, micro_batch_tokens=48, accum=2, lr=2e-3, warmup=5, grad_clip=1.0,
                      weight_decay=0.1, betas=(0.9, 0.95))
    ours = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300), seed=7)
    trainer = Trainer(ours, PackedDataset(_tokens(4000, 1), cfg.seq_len, cfg.micro_batch_tokens, 0), cfg)
    plain = PlainTrainer(ours, cfg)
    names = dict(plain.named_parameters())
    for step in range(cfg.steps):
        window = trainer.window()
        ref = plain.step(window)
        rec = trainer.step(window)
        assert abs(rec["loss"] - ref["loss"]) <= 2e-5, (step, rec["loss"], ref["loss"])
        worst = max(float((p - names[n]).abs().max()) for n, p in ours.named_parameters())
        assert worst <= 3e-5, (step, worst)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "qwen3_moe", "gemma3_text"])
def test_finite_difference_gradients_float64(family):
    extra = {"qwen3_moe": dict(mlp_only_layers=()),
             "gemma3_text": dict(sliding_window=4, layer_types=("sliding_attention",))}.get(family, {})
    model = Transformer.from_config(ModelConfig.tiny(family, vocab_size=64, hidden_size=32, intermediate_size=48,
                                                     num_heads=4, num_kv_heads=2, head_dim=8, num_layers=1,
                                                     tie_word_embeddings=False, **extra), seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=gen) for n in (9, 5)]

    def loss():
        return train.cross_entropy_sum(model, seqs)[0]

    loss().backward()
    kinds = {}
    for name, p in model.named_parameters():
        kind = name.split(".")[-2] + "." + name.split(".")[-1]
        kinds.setdefault(kind, (name, p))
    assert {"embed_tokens.weight", "q_proj.weight", "o_proj.weight", "down_proj.weight", "lm_head.weight",
            "input_layernorm.weight", "norm.weight"} <= set(kinds)
    assert {"qwen3_moe": {"gate.weight"}, "gemma3_text": {"pre_feedforward_layernorm.weight",
                                                          "post_feedforward_layernorm.weight"}}.get(family, set()) <= set(kinds)
    h = 1e-6
    for kind, (name, p) in kinds.items():
        flat = p.data.view(-1)
        for idx in torch.randint(0, flat.numel(), (3,), generator=gen).tolist():
            old = float(flat[idx])
            with torch.no_grad():
                flat[idx] = old + h
                up = float(loss())
                flat[idx] = old - h
                down = float(loss())
                flat[idx] = old
            numeric = (up - down) / (2 * h)
            analytic = float(p.grad.view(-1)[idx])
            assert abs(numeric - analytic) <= 1e-6 + 1e-5 * abs(numeric), (name, idx, numeric, analytic)


def test_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(40, 7))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours = AdamW([("w", p1)], AdamWConfig(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05))
    ref = torch.optim.AdamW([p2], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    for _ in range(20):
        g = torch.randn(40, 7)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step(1e-2)
        ref.step()
    torch.testing.assert_close(p1, p2, atol=1e-6, rtol=1e-5)


def test_adamw_keeps_a_float64_parameter_in_float64():
    """A float64 parameter's state and update are float64 (docs/adr/0027): one step is the update
    restated in float64, one IEEE operation at a time, with the IEEE root. Computed in fp32, as it
    was, the weights after a step would be fp32 values."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(1000, generator=gen, dtype=torch.float64)
    g = torch.randn(1000, generator=gen, dtype=torch.float64) * 1e-3
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    lr, (b1, b2), eps, wd = 1e-3, (0.9, 0.95), 1e-8, 0.1
    opt = AdamW([("w", p)], AdamWConfig(lr, (b1, b2), eps, wd))
    opt.step(lr)
    assert opt.exp_avg["w"].dtype == opt.exp_avg_sq["w"].dtype == torch.float64
    bc1, bc2_sqrt = 1 - exact_math.power(b1, 1), math.sqrt(1 - exact_math.power(b2, 1))
    m, v = g * (1 - b1), (g * g) * (1 - b2)
    root = torch.tensor([math.sqrt(x) for x in v.tolist()], dtype=torch.float64)
    want = w0 * (1 - lr * wd) - (m / (root / bc2_sqrt + eps)) * (lr / bc1)
    assert torch.equal(p.detach(), want)
    assert not torch.equal(want, want.float().double())


def test_the_gradient_norm_of_float64_gradients_is_float64():
    """Gradients of 1e-30 square to 1e-60, below fp32's smallest number: summed in fp32, as they were,
    the norm was 0 and clipping saw nothing. In float64 it is their norm to within the rounding of a
    sum of n positive terms (n units in the last place, halved by the root); fp32 gradients keep an
    fp32 norm."""
    gen = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(40, 30, generator=gen, dtype=torch.float64) * 1e-30,
             "b": torch.randn(30, generator=gen, dtype=torch.float64) * 1e-30}
    norm = train.grad_norm(grads)
    exact = sum(Fraction(x) ** 2 for g in grads.values() for x in g.reshape(-1).tolist())
    n = sum(g.numel() for g in grads.values())
    sliced = train.grad_norm(grads, parts={"w": (0, 2)})      # tensor parallelism's slices: another tree
    for got in (norm, sliced):
        assert got.dtype == torch.float64
        assert abs(Fraction(got.item()) ** 2 - exact) <= exact * n * Fraction(2) ** -52
    assert train.grad_norm({k: g.float() for k, g in grads.items()}).dtype == torch.float32


@pytest.mark.parametrize("kw, message", [
    (dict(betas=(0.9, 1.0)), r"betas: expected two numbers in \[0, 1\), got \(0.9, 1.0\)"),
    (dict(betas=(-0.1, 0.9)), r"betas: expected two numbers in \[0, 1\)"),
    (dict(eps=0.0), "eps: expected a positive number, got 0.0"),
])
def test_adamw_config_names_a_bad_setting(kw, message):
    with pytest.raises(ValueError, match=message):
        AdamWConfig(**kw)


def test_policy_loss_clips_and_its_slope_is_autograds():
    lp = torch.tensor([0.0, 0.5, -0.5, 0.1, -0.1])
    old = torch.zeros(5)
    adv = [1.0, 1.0, -1.0, -1.0, 2.0]
    loss = PolicyLoss([old[:2], old[2:]], [1.0, -1.0])  # advantages per sequence: 2 + 3 tokens
    value, slope = PolicyLoss([old[i:i + 1] for i in range(5)], adv).terms(lp, 0, 5)
    # Tokens 1 (r = e^0.5 > 1.2, A > 0) and 2 (r = e^-0.5 < 0.8, A < 0) are clipped: flat.
    assert value[1] == -1.2 * 1.0 and value[2] == -(0.8 * -1.0)
    assert slope[1] == 0 and slope[2] == 0 and slope[0] == -1.0
    leaf = lp.clone().requires_grad_(True)
    a = torch.tensor(adv)
    r = torch.exp(leaf - old)
    torch.minimum(r * a, torch.clamp(r, 0.8, 1.2) * a).neg().sum().backward()
    assert torch.allclose(slope, leaf.grad, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="advantages: expected one per sequence"):
        PolicyLoss([old[:2], old[2:]], [1.0])
    assert loss.mean == "token"


def test_lr_schedule():
    assert train.lr_at(0, 1.0, 10, 100) == 0.1
    assert train.lr_at(9, 1.0, 10, 100) == 1.0
    assert math.isclose(train.lr_at(100, 1.0, 10, 100), 0.1)


def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    t = _trainer()
    _run(t, 2)
    t.save(str(tmp_path))
    _run(t, 1)
    real = os.replace

    def crash(src, dst):
        if "step-000003" in str(dst):
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match=r"checkpoint .*step-000003: not written \(OSError: disk full\); the previous"):
        t.save(str(tmp_path))
    monkeypatch.setattr(os, "replace", real)
    assert (tmp_path / "latest").read_text() == "step-000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002"], "the half-written folder is removed"
    fresh = _trainer()
    assert fresh.resume(str(tmp_path)) == 2


def test_a_full_disk_while_writing_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    import safetensors.torch

    t = _trainer()
    _run(t, 1)
    t.save(str(tmp_path))
    _run(t, 1)

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)             # what a write cut short leaves behind
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match=r"step-000002: not written \(SafetensorError: .*No space left on device"):
        t.save(str(tmp_path))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
    assert _trainer().resume(str(tmp_path)) == 1


@pytest.mark.parametrize("keep, left", [(2, ["step-000003", "step-000004"]), (1, ["step-000004"]),
                                        (0, ["step-000001", "step-000002", "step-000003", "step-000004"])])
def test_only_the_newest_checkpoints_are_kept(tmp_path, keep, left):
    t = _trainer(keep_checkpoints=keep)
    for _ in range(4):
        _run(t, 1)
        t.save(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", *left]
    assert _trainer().resume(str(tmp_path)) == 4


def test_checkpoint_of_another_model_is_refused(tmp_path):
    t = _trainer()
    _run(t, 1)
    t.save(str(tmp_path))
    other = Trainer(Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300)),
                    PackedDataset(_tokens(), 32, 96, 0), TrainConfig(seq_len=32, micro_batch_tokens=96))
    with pytest.raises(ValueError, match="belongs to another model"):
        other.resume(str(tmp_path))


@pytest.mark.parametrize("missing", ["rng", "weight"])
def test_an_incomplete_checkpoint_is_named_on_resume(tmp_path, missing):
    import json
    import re

    from safetensors.torch import load_file, save_file

    t = _trainer()
    _run(t, 1)
    ckpt = t.save(str(tmp_path))
    if missing == "rng":            # read from trainer_state.json
        state_file = os.path.join(ckpt, "trainer_state.json")
        with open(state_file) as f:
            state = json.load(f)
        del state["rng"]
        with open(state_file, "w") as f:
            json.dump(state, f)
        what = "KeyError: 'rng'"
    else:                           # met by the trainer as it puts the weights in place
        weights = os.path.join(ckpt, "model.safetensors")
        tensors = load_file(weights)
        name = sorted(tensors)[0]
        del tensors[name]
        save_file(tensors, weights, metadata={"format": "pt"})
        what = f"KeyError: '{name}'"
    fresh = _trainer()
    with pytest.raises(ValueError, match=re.escape(f"resume: checkpoint {ckpt} is incomplete or damaged ({what})")):
        fresh.resume(str(tmp_path))
    assert fresh.step_idx == 0 and fresh.resumed_extra == {}


def test_nan_loss_stops_with_the_step_named(tmp_path, monkeypatch):
    t = _trainer()
    _run(t, 1)
    with torch.no_grad():
        t.model.model.embed_tokens.weight.fill_(float("nan"))
    with pytest.raises(train.NonFiniteLoss, match="non-finite loss nan at step 1"):
        t.step()


def test_cli_trains_and_loss_falls(tmp_path, capsys):
    from lockstep import cli

    data = tmp_path / "data.txt"
    data.write_text("the cat sat on the mat. " * 400)
    out = tmp_path / "run"
    assert cli.main(["train", "--data", str(data), "--steps", "25", "--lr", "3e-3", "--micro-batch-tokens", "128",
                     "--seq-len", "32", "--out", str(out)]) == 0
    log, events = train.read_log(str(out))
    assert len(log) == 25 and log[-1]["loss"] < 0.6 * log[0]["loss"]
    assert [e["event"] for e in events] == ["start"]
    assert (out / "latest").read_text() == "step-000025"
    # resume to 30 steps
    assert cli.main(["train", "--data", str(data), "--steps", "30", "--lr", "3e-3", "--micro-batch-tokens", "128",
                     "--seq-len", "32", "--out", str(out), "--resume"]) == 0
    assert (out / "latest").read_text() == "step-000030"


def test_cli_help_explains_every_option(capsys):
    from lockstep import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for opt in ("--model", "--data", "--steps", "--micro-batch-tokens", "--accum", "--lr", "--out", "--resume",
                "--seq-len", "--warmup", "--grad-clip", "--dtype", "--master-weights", "--seed", "--save-every"):
        assert opt in text


@pytest.mark.parametrize("args, message", [
    (["--data", "/nonexistent/file.txt"], "data: '/nonexistent/file.txt' does not exist"),
    (["--steps", "0"], "steps: expected a positive int"),
])
def test_cli_bad_input(tmp_path, capsys, args, message):
    from lockstep import cli

    data = tmp_path / "d.txt"
    data.write_text("hello world " * 100)
    argv = ["train", "--data", str(data), "--out", str(tmp_path / "o")] + args
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_tokenizer_vocabulary_mismatch_is_refused(tmp_path):
    model = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=100))
    model.save(str(tmp_path / "m"))
    data = tmp_path / "d.txt"
    data.write_text("hello " * 50)
    with pytest.raises(ValueError, match="beyond the model's vocabulary of 100"):
        train.make_model_and_tokens(str(tmp_path / "m"), str(data), torch.float32, 0)


def _cli_train(tmp_path, *extra, steps=4, out="run"):
    from lockstep import cli

    data = tmp_path / "data.txt"
    if not data.exists():
        data.write_text("the cat sat on the mat. " * 300)
    return cli.main(["train", "--data", str(data), "--steps", str(steps), "--seq-len", "32",
                     "--micro-batch-tokens", "64", "--out", str(tmp_path / out), *extra])


@pytest.mark.parametrize("flag, value, name", [
    ("--accum", "2", "window (sequences per step; accum 1 -> 2 changed it"), ("--lr", "0.01", "lr: "),
    ("--seq-len", "16", "seq_len: "), ("--micro-batch-tokens", "128", "micro_batch_tokens 64 -> 128 changed it"),
    ("--dtype", "bf16", "dtype: "), ("--seed", "3", "seed: "), ("--warmup", "2", "warmup: "),
])
def test_resume_refuses_a_setting_that_changes_the_run(tmp_path, capsys, flag, value, name):
    assert _cli_train(tmp_path) == 0
    capsys.readouterr()
    assert _cli_train(tmp_path, "--resume", flag, value, steps=6) == 2      # the last of a repeated flag wins
    err = capsys.readouterr().err
    assert name in err and "in the checkpoint" in err and "start a new run" in err, err
    assert "Traceback" not in err


def test_resume_at_another_micro_batch_size_continues_bitwise_and_logs_it(tmp_path, capsys):
    """The window is kept (2 x 64 tokens -> 1 x 128): the layout may change, and the run goes on as if
    it had not."""
    assert _cli_train(tmp_path, "--accum", "2", out="whole", steps=6) == 0
    assert _cli_train(tmp_path, "--accum", "2", out="split", steps=3) == 0
    assert _cli_train(tmp_path, "--resume", "--accum", "1", "--micro-batch-tokens", "128", out="split", steps=6) == 0
    assert "micro_batch_tokens 64 -> 128" in capsys.readouterr().err
    whole, _ = train.read_log(str(tmp_path / "whole"))
    split, events = train.read_log(str(tmp_path / "split"))
    assert [(r["loss"], r["grad_norm"]) for r in split] == [(r["loss"], r["grad_norm"]) for r in whole]
    layouts = events[-1]["changes"]["layout"]
    assert (layouts[0]["accum"], layouts[1]["accum"]) == (2, 1)
    same = [open(tmp_path / d / "step-000006" / "model.safetensors", "rb").read() for d in ("whole", "split")]
    assert same[0] == same[1]


def test_resume_refuses_other_data(tmp_path, capsys):
    assert _cli_train(tmp_path) == 0
    (tmp_path / "data.txt").write_text("a different corpus, entirely. " * 300)
    assert _cli_train(tmp_path, "--resume", steps=6) == 2
    assert "data: " in capsys.readouterr().err


def test_resume_allows_and_logs_more_steps(tmp_path, capsys):
    assert _cli_train(tmp_path) == 0
    assert _cli_train(tmp_path, "--resume", steps=6) == 0
    assert "steps 4 -> 6" in capsys.readouterr().err
    steps, events = train.read_log(str(tmp_path / "run"))
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [e["event"] for e in events] == ["start", "resume"] and events[1]["changes"] == {"steps": [4, 6]}


def test_a_resumed_log_holds_each_step_once(tmp_path):
    # A run killed after step 8 whose last complete checkpoint is step 5: the log holds steps 6-8 that the
    # resumed run recomputes.
    assert _cli_train(tmp_path, "--save-every", "5", steps=8) == 0
    run = tmp_path / "run"
    (run / "latest").write_text("step-000005")
    assert _cli_train(tmp_path, "--save-every", "5", "--resume", steps=10) == 0
    steps, events = train.read_log(str(run))
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert events[-1]["event"] == "resume" and events[-1]["dropped_log_records"] == 3
    # ... and the same losses as an uninterrupted run
    assert _cli_train(tmp_path, "--save-every", "5", steps=10, out="straight") == 0
    assert [r["loss"] for r in steps] == [r["loss"] for r in train.read_log(str(tmp_path / "straight"))[0]]


def test_a_non_empty_out_needs_resume_or_overwrite(tmp_path, capsys):
    assert _cli_train(tmp_path, steps=3) == 0
    assert _cli_train(tmp_path, steps=2) == 2
    assert "is not empty" in capsys.readouterr().err and (tmp_path / "run" / "latest").read_text() == "step-000003"
    assert _cli_train(tmp_path, "--overwrite", steps=2) == 0
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "log.jsonl", "step-000002"]
    assert [r["step"] for r in train.read_log(str(run))[0]] == [1, 2]
    (run / "notes.txt").write_text("mine")
    assert _cli_train(tmp_path, "--overwrite", steps=2) == 2
    assert "did not write (notes.txt)" in capsys.readouterr().err and (run / "notes.txt").exists()


@pytest.mark.parametrize("victim, damage, message", [
    ("model.safetensors", "truncate", "model.safetensors is not a readable safetensors file"),
    ("optimizer.safetensors", "garbage", "optimizer.safetensors is not a readable safetensors file"),
    ("trainer_state.json", "truncate", "trainer_state.json is not valid JSON"),
])
def test_a_damaged_checkpoint_is_named_on_resume(tmp_path, capsys, victim, damage, message):
    assert _cli_train(tmp_path, steps=2) == 0
    path = tmp_path / "run" / "step-000002" / victim
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage == "truncate" else b"\x01 not safetensors " * 50)
    capsys.readouterr()
    assert _cli_train(tmp_path, "--resume", steps=3) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, message", [
    (["--warmup", "-3"], "warmup: expected an int >= 0, got -3"),
    (["--weight-decay", "-1"], "weight_decay: expected a number >= 0, got -1.0"),
    (["--save-every", "-1"], "save_every: expected an int >= 0, got -1"),
    (["--keep-checkpoints", "-2"], "keep_checkpoints: expected an int >= 0, got -2"),
    (["--dtype", "fp16"], "dtype: expected fp32 or bf16"),
    (["--lr", "nan"], "lr: expected a positive number"),
])
def test_train_refuses_bad_settings(tmp_path, capsys, args, message):
    assert _cli_train(tmp_path, *args) == 2
    assert message in capsys.readouterr().err


def test_train_help_shows_the_defaults(capsys):
    from lockstep import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 256)" in text and "(default: 0.001)" in text and "per data-parallel rank" in text


NEW_FAMILIES = ["qwen3_moe", "gemma3_text"]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_replay_and_resume_are_bitwise_for_moe_and_gemma(family, tmp_path):
    a = _trainer(dtype=torch.bfloat16, master_weights=True, family=family)
    b = _trainer(dtype=torch.bfloat16, master_weights=True, family=family)
    ra, rb = _run(a, 4), _run(b, 2)
    b.save(str(tmp_path))
    resumed = _trainer(dtype=torch.bfloat16, master_weights=True, family=family)
    assert resumed.resume(str(tmp_path)) == 2
    rb += _run(resumed, 2)
    assert [(r["loss"], r["grad_norm"]) for r in ra] == [(r["loss"], r["grad_norm"]) for r in rb]
    assert a.params_digest() == resumed.params_digest()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_window_gradients_of_moe_and_gemma_do_not_depend_on_the_micro_batches(family):
    a = _trainer(family=family, accum=4, micro_batch_tokens=32)
    b = _trainer(family=family, accum=1, micro_batch_tokens=1000)
    window = a.window()
    window = [s[:20] if i >= 2 else s for i, s in enumerate(window)]
    assert a.accumulate(window) == b.accumulate(window)
    assert a.grads.keys() == b.grads.keys() == {n for n, _ in a.named}
    for n in a.grads:
        assert torch.equal(a.grads[n], b.grads[n]), n


def test_router_aux_loss_enters_the_objective_per_sequence_and_keeps_layout_invariance():
    def trainer(mb, accum, coef):
        t = _trainer(family="qwen3_moe", accum=accum, micro_batch_tokens=mb)
        t.model.config.output_router_logits, t.model.config.router_aux_loss_coef = True, coef
        return t

    window = trainer(32, 4, 0.5).window()
    a, b, off = trainer(32, 4, 0.5), trainer(1000, 1, 0.5), trainer(1000, 1, 0.0)
    la, lb, loff = a.accumulate(window), b.accumulate(window), off.accumulate(window)
    assert la == lb and la[0] > loff[0]
    router = "model.layers.1.mlp.gate.weight"
    assert all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads)
    assert not torch.equal(a.grads[router], off.grads[router])
    # The objective is the token-mean cross-entropy plus coef x the mean of each sequence's loss.
    from lockstep.model.moe import load_balancing_loss, record_router_logits

    model = off.model
    aux = []
    with torch.no_grad():
        for s in window:
            with record_router_logits() as logits:
                packed_logprobs(model, [s])
            aux.append(float(load_balancing_loss(logits, 8, 2)))
    assert abs(la[0] - (loff[0] + 0.5 * sum(aux) / len(aux))) <= contract.chain_tolerance(torch.float32)


def test_a_gradient_from_outside_the_unit_trees_is_refused_with_the_backends_that_fit():
    from lockstep import registry

    t = _trainer()
    with registry.use_backend("eager"), pytest.raises(RuntimeError) as refused:
        t.step()
    message = str(refused.value)
    assert "came from an op outside the unit trees (backend 'eager')" in message, message
    assert "train on the native, portable or triton backend, or pass layout_invariant=False" in message, message
