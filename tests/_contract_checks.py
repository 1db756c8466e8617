"""Shared assertions: an op's full contract (every sweep bitwise, accuracy from contract.toml)."""

import torch

from lockstep import registry
from lockstep.harness.check import check_op

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_op_contract(op: str, dtype: torch.dtype, backend: str | None = None) -> None:
    """Every sweep and the accuracy of `op` on `backend` (default: the CPU's, native where it builds)."""
    report = check_op(op, dtype, backend=backend or registry.cpu_backend())
    failures = [f"{s.sweep}: {s.detail} (max diff {s.max_diff:.3e})" for s in report.sweeps if not s.passed]
    assert not failures, f"{op} {dtype} invariance failures: {failures}"
    assert all(s.compared > 0 for s in report.sweeps), "a sweep compared no rows"
    expected = {"batch=1 (row 0)", "batch=2", "batch=7", "batch=133", "permutation", "pad left", "pad right",
                "NaN/Inf rows", "strided", "repeat (determinism)", "threads=1 vs 2"}
    assert expected <= {s.sweep for s in report.sweeps}
    a = report.accuracy
    assert a.forward_excess <= 0, f"forward error {a.forward_max_abs:.3e} outside the contract"
    assert a.gradient_excess is None or a.gradient_excess <= 0, f"gradient error {a.gradient_max_abs:.3e} outside the contract"
    gradient = ("" if a.gradient_max_abs is None or a.eager_gradient_max_abs is None else
                f", gradient {a.gradient_max_abs:.3e} against {a.eager_gradient_max_abs:.3e}")
    assert a.relative_ok, (f"error more than 2x eager PyTorch's (plus an ulp): forward {a.forward_max_abs:.3e} against "
                           f"{a.eager_forward_max_abs:.3e}{gradient}")


def assert_attention_report(report, sweeps: set[str], with_accuracy: bool = True) -> None:
    """An attention check's report (attention or masked_attention): every sweep bitwise, each of
    `sweeps` among them, and the accuracy within the contract."""
    failures = [f"{s.sweep}: {s.detail} ({s.max_diff:.3e})" for s in report.sweeps if not s.passed]
    assert not failures, failures
    assert all(s.compared > 0 for s in report.sweeps)
    assert sweeps <= {s.sweep for s in report.sweeps}
    if with_accuracy:
        a = report.accuracy
        assert a.forward_excess <= 0 and a.gradient_excess <= 0, a
        assert a.relative_ok, a
