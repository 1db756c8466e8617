"""The checks themselves must be able to fail: planted defects are caught by the right sweep."""

import json

import pytest
import torch

from lockstep import cli
from lockstep.registry import register
from lockstep.harness.check import check_op
from lockstep.backends.portable.rms_norm import rms_norm as portable_rms_norm


@register("planted-batch-dependent", "rms_norm")
def _batch_dependent(x, weight, eps, offset):
    y = portable_rms_norm(x, weight, eps, offset)
    return y + (x.shape[0] % 7) * 1e-7     # depends on how many rows share the call


@register("planted-inaccurate", "rms_norm")
def _inaccurate(x, weight, eps, offset):
    return portable_rms_norm(x, weight, eps, offset) * (1 + 3e-4)


@register("planted-nondeterministic", "rms_norm")
def _nondeterministic(x, weight, eps, offset):
    y = portable_rms_norm(x, weight, eps, offset)
    return y + torch.rand(()) * 1e-6


def _failed(report):
    return {s.sweep for s in report.sweeps if not s.passed}


def test_batch_dependence_is_caught():
    report = check_op("rms_norm", torch.float32, backend="planted-batch-dependent", with_accuracy=False)
    assert {"batch=1 (row 0)", "batch=2", "pad left", "pad right"} <= _failed(report)
    assert "repeat (determinism)" not in _failed(report)


def test_inaccuracy_is_caught_but_invariance_passes():
    report = check_op("rms_norm", torch.float32, backend="planted-inaccurate")
    assert report.invariant
    assert not report.accuracy.passed and report.accuracy.forward_excess > 0


def test_nondeterminism_is_caught():
    report = check_op("rms_norm", torch.float32, backend="planted-nondeterministic", with_accuracy=False)
    assert "repeat (determinism)" in _failed(report)


def test_eager_linear_fails_the_one_row_sweep():
    report = check_op("linear", torch.float32, backend="eager", with_accuracy=False)
    assert not report.invariant
    assert any(s.sweep.startswith("batch=1") for s in report.sweeps if not s.passed)


def test_cli_check_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert cli.main(["check", "silu_mul", "--dtype", "fp32", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "silu_mul" in out and "1 passed, 0 failed" in out
    data = json.loads(path.read_text())
    assert data["reports"][0]["invariant"] is True and data["reports"][0]["op"] == "silu_mul"


def test_cli_check_eager_reports_failures(capsys):
    assert cli.main(["check", "linear", "--dtype", "fp32", "--backend", "eager"]) == 1
    out = capsys.readouterr().out
    assert "FAIL batch=1" in out and "0 passed, 1 failed" in out


@pytest.mark.parametrize("argv, message", [
    (["check", "matmul"], "op: unknown op 'matmul'"),
    (["check", "--dtype", "fp8"], "dtype: unknown dtype 'fp8'"),
    (["check", "--backend", "tpu"], "backend: unknown backend 'tpu'"),
])
def test_cli_bad_arguments(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_check_writes_into_a_folder_it_creates(tmp_path, capsys):
    path = tmp_path / "a" / "b" / "x.json"
    assert cli.main(["check", "silu_mul", "--dtype", "fp32", "--json", str(path), "--html", str(tmp_path / "h" / "r.html")]) == 0
    assert json.loads(path.read_text())["reports"][0]["op"] == "silu_mul"
    page = (tmp_path / "h" / "r.html").read_text()
    assert "<h2>Operator contract</h2>" in page and ">silu_mul</td>" in page, page[-2000:]


def test_cli_check_refuses_an_unwritable_output_before_any_work(tmp_path, capsys, monkeypatch):
    from lockstep import harness

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(harness, "check", lambda *a, **k: pytest.fail("checked before the output path"))
    assert cli.main(["check", "silu_mul", "--json", str(blocker / "x.json")]) == 2
    assert "json: cannot create the folder" in capsys.readouterr().err


def test_cli_check_prints_each_row_as_it_finishes(capsys, monkeypatch):
    from lockstep import harness

    real, seen = harness.check, []

    def spy(name, dtype, **kw):
        seen.append(capsys.readouterr().out)          # what was printed before this check began
        return real(name, dtype, **kw)

    monkeypatch.setattr(harness, "check", spy)
    assert cli.main(["check", "silu_mul", "embedding", "--dtype", "fp32"]) == 0
    assert "silu_mul" in seen[1] and "float32" in seen[1], "the first row is printed before the second check runs"


def test_cli_check_says_exact_rather_than_a_zero_ratio(capsys):
    assert cli.main(["check", "embedding", "--dtype", "fp32", "--no-grad"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("embedding"))
    assert " exact " in row and " 0.00 " not in row


def test_cli_check_refuses_an_op_the_backend_does_not_implement(capsys):
    # attention's check decodes from a paged cache, and the reference backend has no paged_attention.
    assert cli.main(["check", "attention", "--backend", "reference"]) == 2
    assert "backend 'reference' does not implement ['paged_attention']" in capsys.readouterr().err
