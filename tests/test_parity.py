import dataclasses
import json
import os
import shutil
import subprocess

import pytest
import torch

from lockstep import cli, contract, parity, registry
from lockstep.registry import register, register_backend
from lockstep.model import ModelConfig, Transformer
from lockstep.parity import RunConfig, trajectories, ulp_distance
from lockstep.numerics.fixed_order import row_sum
from lockstep.backends.portable.linear import linear as portable_linear
from lockstep.backends.portable.rms_norm import rms_norm as portable_rms_norm
from lockstep.tools.report import build_html

LINEARS_PER_LAYER = 7            # q, k, v, o, gate, up, down
_calls = {"linear": 0}


@register("planted-ulp", "linear")
def _planted_linear(x, weight, bias, *splits):
    """One ulp added to one element of the output of one linear call: layer 1's down_proj, row 0's
    largest element."""
    y = portable_linear(x, weight, bias, *splits)
    if _calls["linear"] % (2 * LINEARS_PER_LAYER) == LINEARS_PER_LAYER + 6:
        with torch.no_grad():
            delta = torch.zeros_like(y)
            j = int(y[0].abs().argmax())
            delta[0, j] = torch.nextafter(y[0, j], torch.tensor(float("inf"), dtype=y.dtype)) - y[0, j]
        y = y + delta                 # exact: adjacent floats differ by a representable step
    _calls["linear"] += 1
    return y


class _ReorderedBackward(torch.autograd.Function):
    """rms_norm with the portable forward and a backward that sums in another order."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset = eps, offset
        with torch.no_grad():
            return portable_rms_norm(x, weight, eps, offset)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        rstd = torch.rsqrt(row_sum(x * x) / x.shape[-1] + ctx.eps)[:, None]
        xhat = x * rstd
        gw = g * (w + ctx.offset)
        dot = torch.flip(gw * xhat, dims=[-1]).sum(-1, keepdim=True) / x.shape[-1]   # reversed order
        return rstd * (gw - xhat * dot), (g * xhat).sum(0), None, None


@register("planted-backward", "rms_norm")
def _planted_rms_norm(x, weight, eps, offset):
    return _ReorderedBackward.apply(x.contiguous(), weight, eps, offset)


register_backend("planted-ulp", fallback="portable")
register_backend("planted-backward", fallback="portable")


@pytest.fixture
def model():
    return Transformer.from_config(ModelConfig.tiny("llama"), seed=0)


def test_planted_one_ulp_change_is_named_by_op_and_layer(model):
    """The planted ulp is found at its op, and the records it changed later are listed. At random
    init the MLP's output is a small fraction of the residual stream it is added to, so one ulp of
    it vanishes in that sum for about half the seeds; scaled by 2^10 (exactly), it outweighs the
    stream and its largest element's ulp reaches the final norm (16 seeds of 16)."""
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1024.0)
    _calls["linear"] = 0
    c = parity.parity(model, RunConfig(backend="portable"), RunConfig(backend="planted-ulp"))
    d = c.first["forward"]
    assert d is not None and d.module == "model.layers.1.mlp.down_proj" and d.op == "linear"
    assert d.max_ulp_diff == 1 and d.differing == 1
    assert d.contaminated_count > 0 and any("model.norm" in name for name in d.contaminated)


def test_planted_backward_reordering_is_found_in_backward_only(model):
    c = parity.parity(model, RunConfig(backend="portable"), RunConfig(backend="planted-backward"))
    assert c.first["forward"] is None and c.compared["forward"] > 0
    d = c.first["backward"]
    assert d is not None and d.op == "rms_norm" and d.module == "model.norm"


@pytest.mark.parametrize("a, b, identical", [
    ("layout=alone", "layout=batch8", True),
    ("layout=alone", "layout=decode", True),
    ("layout=alone", "layout=chunk7", True),
    ("backend=eager,layout=alone", "backend=eager,layout=decode", False),
])
def test_layouts(model, a, b, identical):
    c = parity.parity(model, RunConfig.parse(a), RunConfig.parse(b))
    assert c.compared["forward"] > 0
    assert (c.first["forward"] is None) == identical
    if not identical:
        assert c.first["forward"].op == "linear"        # the GEMV path for one row


def test_recorder_records_engine_and_trainer_calls_alike(model):
    from lockstep import Engine, SamplingParams
    from lockstep.train import cross_entropy_sum

    with parity.Recorder(model) as rec:
        Engine(model).generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    ops_engine = {r.op for r in rec.forward}
    with parity.Recorder(model) as rec2:
        cross_entropy_sum(model, [torch.tensor([1, 2, 3, 4])])[0].backward()
    assert {"embedding", "rms_norm", "linear", "rope", "silu_mul", "paged_attention", "vocab_logprobs"} <= ops_engine
    assert {"attention", "selected_logprobs"} <= {r.op for r in rec2.forward} and rec2.backward
    assert all(r.module for r in rec2.forward if r.op == "rms_norm")


def test_ulp_distance():
    a = torch.tensor([1.0, -2.0, 0.0])
    b = torch.nextafter(a, torch.tensor(float("inf")))
    assert ulp_distance(a, b) == 1
    assert ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0])) == 0
    assert ulp_distance(a.bfloat16(), a.bfloat16()) == 0


def test_trajectory_against_the_plain_pytorch_trainer(model):
    """The default CPU trainer (native) stays within the trainer-parity contract of plain PyTorch,
    whose bound scales with PyTorch's own error, the plain trainer's distance from the float64
    trainer (docs/adr/0031).

    AdamW's first steps turn a gradient element within rounding of zero into a parameter change of
    up to about lr * 0.05, whoever computes it, so the largest parameter difference is a draw. In
    five BLAS orders (this AMD machine's MKL at 2 threads, and tests/_reblocking_blas.py's
    "threads" at 2 and 3 threads and "rows" at 1 and 2) and seeds 0-11, native and portable
    against plain stayed within the contract in 60 of 60 runs each, using at most 0.87 of the
    bound (2026-11-28). Under the bound before it, twice the plain trainer's distance from the
    eager backend's, native left it at seed 1 in 2 of the 5 orders and portable at seed 9 in 2."""
    from lockstep.train import PackedDataset, TrainConfig, Trainer

    tokens = torch.randint(0, 512, (6000,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = TrainConfig(steps=6, seq_len=24, micro_batch_tokens=48, accum=2, lr=2e-3, warmup=2)

    def make():
        return Trainer(Transformer.from_config(ModelConfig.tiny("llama"), seed=0),
                       PackedDataset(tokens, cfg.seq_len, cfg.micro_batch_tokens, 0), cfg)

    result = parity.compare_trajectories(make, "native", "plain", steps=6)
    assert len(result["rows"]) == 6 and result["first_step_outside_contract"] is None
    assert result["loss_tol"] == 2e-5
    limits = contract.load()["trainer_parity"]
    assert result["pytorch_error_factor"] == limits["pytorch_error_factor"]
    assert all(r["max_param_diff"] <= limits["params"] + limits["pytorch_error_factor"] * r["pytorch_param_error"]
               for r in result["rows"])
    assert all(0 < r["pytorch_param_error"] < 1e-4 for r in result["rows"])
    truth, plain, window = trajectories._float64_trainer(make()), trajectories.PlainTrainer(make().model, cfg), make().window()
    assert {p.dtype for _, p in truth.named} == {torch.float64}
    with registry.use_backend("reference"):
        truth_loss = truth.step(window)["loss"]
    plain_loss = plain.step(window)["loss"]          # the error is the plain trainer's distance from float64
    assert result["rows"][0]["pytorch_loss_error"] == abs(truth_loss - plain_loss)
    assert result["rows"][0]["pytorch_param_error"] == trajectories._max_param_diff(dict(truth.named),
                                                                                    dict(plain.named_parameters()))
    sides = iter([4.0, 1.0, 1.0])            # side a trains at 4x the learning rate: outside, PyTorch's error or not

    def make_off():
        t = make()
        t.cfg = dataclasses.replace(t.cfg, lr=t.cfg.lr * next(sides))
        return t
    assert parity.compare_trajectories(make_off, "portable", "plain", steps=1)["first_step_outside_contract"] == 1
    bitwise = parity.compare_trajectories(make, "portable", "portable", steps=3)
    assert bitwise["first_step_outside_contract"] is None and all(r["loss_diff"] == 0 for r in bitwise["rows"])
    diverging = parity.compare_trajectories(make, "portable", "eager", steps=2)
    assert diverging["first_step_outside_contract"] == 1
    assert diverging["first_diverging_op"]["first"]["forward"] is not None


def test_parity_cli_and_report_dir(tmp_path, capsys):
    # Diverging runs exit 1; identical ones 0.
    assert cli.main(["parity", "--a", "backend=eager", "--b", "backend=portable", "--json",
                     str(tmp_path / "parity.json")]) == 1
    assert "first divergence" in capsys.readouterr().out
    assert cli.main(["parity", "--a", "layout=alone", "--b", "layout=batch8"]) == 0
    assert "identical" in capsys.readouterr().out
    assert cli.main(["parity", "--a", "layout=alone", "--b", "layout=batch20"]) == 0
    assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").exists()
    assert cli.main(["report", str(tmp_path / "nope")]) == 2


def test_parity_cli_never_calls_zero_comparisons_identical(capsys):
    assert cli.main(["parity", "--a", "layout=alone", "--b", "layout=decode"]) == 0
    out = capsys.readouterr().out
    assert "forward : identical" in out.replace("forward  :", "forward :")
    assert "backward: not compared" in out and "backward: identical" not in out


@pytest.mark.parametrize("layout, message", [
    ("sideways", "unknown layout 'sideways'"),
    ("chunk0", "layout 'chunk0' needs N in [1, 256], got 0"),
    ("batch9999", "layout 'batch9999' needs N in [1, 256], got 9999"),
])
def test_parity_cli_refuses_bad_layouts(layout, message, capsys):
    assert cli.main(["parity", "--a", f"layout={layout}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("LOCKSTEP_REQUIRE_BROWSER"):
            pytest.fail("chromium is required (LOCKSTEP_REQUIRE_BROWSER is set) but not installed")
        pytest.skip("chromium not installed; .ci/run installs it and requires this test")
    return path


def test_report_renders_in_headless_chromium(tmp_path, model):
    from lockstep.harness.check import check_op

    data = {
        "check": [check_op("silu_mul", torch.float32).to_dict(), check_op("linear", torch.float32, backend="eager",
                                                                           with_accuracy=True).to_dict()],
        "parity": {**parity.parity(model, RunConfig(backend="portable"), RunConfig(backend="eager")).to_dict(),
                   "a": "portable", "b": "eager"},
        "trajectory": {"side_a": "a", "side_b": "b", "loss_tol": 0.0, "param_tol": 0.0, "first_step_outside_contract": 2,
                       "first_diverging_op": None,
                       "rows": [{"step": i, "loss_a": 5 - i * 0.1, "loss_b": 5 - i * 0.1 + (i > 1) * 1e-6,
                                 "grad_norm_a": 1.0 + i, "grad_norm_b": 1.0 + i, "param_norm_a": 3, "param_norm_b": 3,
                                 "loss_diff": (i > 1) * 1e-6, "grad_norm_diff": 0, "param_norm_diff": 0,
                                 "max_param_diff": i * 1e-7} for i in range(1, 8)]},
    }
    page = tmp_path / "report.html"
    page.write_text(json.loads(json.dumps(build_html(json.loads(json.dumps(data, default=str))))))
    assert "http://" not in page.read_text().replace("http://www.w3.org/2000/svg", "")   # nothing to fetch
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
                           "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    dom = proc.stdout
    assert 'data-ready="1"' in dom, proc.stderr[-2000:]                  # the inline script ran to its end
    assert 'data-plots="3"' in dom and "<svg" in dom and "<polyline" in dom
    assert "Uncaught" not in proc.stderr


def test_report_of_a_training_run_draws_its_curves(tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("the cat sat on the mat. " * 300)
    run = tmp_path / "run"
    assert cli.main(["train", "--data", str(data), "--steps", "4", "--seq-len", "32", "--micro-batch-tokens", "64",
                     "--out", str(run)]) == 0
    assert cli.main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "Training run" in page and page.count("<svg") == 3 and ">loss<" in page and "gradient norm" in page


def test_report_of_a_check_run_says_whether_the_native_bits_are_the_recorded_ones(tmp_path, capsys):
    """`lockstep report` on a folder with `lockstep check --json`'s check.json draws the op table and
    the native-bits line (absent from a check.json of another backend); a check.json that is not
    lockstep check's is named, not a traceback."""
    run = tmp_path / "run"
    assert cli.main(["check", "silu_mul", "--dtype", "fp32", "--no-large", "--json", str(run / "check.json")]) == 0
    assert cli.main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "<h2>Operator contract</h2>" in page and "<p class=pass>Native bits: the recorded ones on " in page
    assert "<p class=pass>Native backend bits: the recorded ones in all " in page
    # A check.json from before the whole backend was compared draws the kernels' paragraph alone.
    from lockstep.tools.report import _native_bits_note

    older = json.loads((run / "check.json").read_text())["native_bits"]
    del older["backend"]
    assert _native_bits_note(older).count("<p class=") == 1
    assert cli.main(["check", "silu_mul", "--dtype", "fp32", "--no-large", "--backend", "portable",
                     "--json", str(run / "check.json")]) == 0
    assert cli.main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "<h2>Operator contract</h2>" in page and "Native bits" not in page
    (run / "check.json").write_text("[1]")
    capsys.readouterr()
    assert cli.main(["report", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (f"lockstep report: run_dir: {run / 'check.json'} is not lockstep "
                                                "check's JSON (expected an object with a \"reports\" list)")


def test_chart_axes_ticks_and_legend():
    import re

    from lockstep.tools.report import line_chart

    svg = line_chart({"|dloss|": [(1, 0.0), (2, 0.0), (3, 2.5e-7), (4, 1e-6)], "max |dparam|": [(1, 0.0), (4, 3e-5)]},
                     "differences", log=True)
    labels = re.findall(r"text-anchor='end' font-size='10'>([^<]+)<", svg)
    assert "0" in labels and all(re.fullmatch(r"1e-?\d+|0", t) for t in labels), labels    # powers of ten, and 0
    assert len(re.findall(r"class='xtick'", svg)) >= 2
    legend_y = [float(y) for y in re.findall(r"y='([\d.]+)' font-size='11' class='legend'", svg)]
    curve_y = [float(y) for pts in re.findall(r"points='([^']+)'", svg) for y in re.findall(r",([\d.]+)", pts)]
    assert legend_y and max(legend_y) < min(curve_y), "the legend sits above every curve"


def test_a_native_trajectory_is_the_layout_invariant_trainers():
    """The native backend's weight gradients go into the unit trees (it runs the portable ops on
    lockstep's kernels), so a trajectory on it is the default Trainer's, bit for bit."""
    from lockstep.train import PackedDataset, TrainConfig, Trainer

    assert "native" in parity.UNIT_TREE_BACKENDS
    tokens = torch.randint(0, 512, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = TrainConfig(steps=2, seq_len=24, micro_batch_tokens=48, accum=2, lr=2e-3, warmup=1)

    def make():
        return Trainer(Transformer.from_config(ModelConfig.tiny("llama"), seed=0),
                       PackedDataset(tokens, cfg.seq_len, cfg.micro_batch_tokens, 0), cfg)

    rows = parity.compare_trajectories(make, "native", "portable", steps=2)["rows"]
    direct = make()
    with registry.use_backend("native"):
        records = [direct.step() for _ in range(2)]
    assert [(r["loss_a"], r["grad_norm_a"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in records]
