"""The invariance sweeps and accuracy checks behind `lockstep check` and the test suite.

    specs.py            how each op's inputs are built (its harness spec, by op name)
    check.py            the row sweeps and the accuracy check of one op
    attention_check.py  attention's sweeps: chunked prefill, paged decode, ...
    masked_attention_check.py  masked attention's sweeps: padding on either side, decode, ...
    model_check.py      a whole model's sweeps and its float64 chain

`check(op, dtype)` runs the check that contract.toml's [ops] table names for an op.
"""

from __future__ import annotations

import torch

from .. import contract
from .attention_check import check_attention
from .check import OpReport, check_large, check_op
from .masked_attention_check import check_masked_attention
from .specs import SPECS

# The checks with sweeps of their own (the others are check_op's row sweeps over a harness spec).
OWN_CHECKS = {"attention": check_attention, "masked_attention": check_masked_attention}


def ops_of_check(name: str) -> list[str]:
    """The ops whose sweeps harness check `name` runs (attention's runs paged_attention's too)."""
    return [op for op in contract.load()["ops"] if contract.op_entry(op)["check"] == name]


def checks_of(backend: str) -> list[str]:
    """The harness checks that `backend` can run (it implements every op of the check), in
    contract.toml order."""
    claimed = set(contract.backend_ops(backend))
    out: list[str] = []
    for op in contract.load()["ops"]:
        name = contract.op_entry(op)["check"]
        if name not in out and set(ops_of_check(name)) <= claimed:
            out.append(name)
    return out


def check(name: str, dtype: torch.dtype, backend: str | None = None, grad: bool = True, seed: int = 0,
          device: str = "cpu", large: bool = False) -> OpReport:
    """Every sweep and the accuracy check of harness check `name` (an op name; see `checks_of`).

    large: also the LLM-width sweep, for the ops whose spec has one."""
    if name in OWN_CHECKS:
        return OWN_CHECKS[name](dtype, backend=backend, grad=grad, seed=seed, device=device)
    report = check_op(name, dtype, backend=backend, grad=grad, seed=seed, device=device)
    if large and SPECS[name].large:
        report.sweeps.append(check_large(name, dtype, backend=backend, seed=seed, device=device))
    return report
