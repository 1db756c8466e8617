"""The invariance sweeps and accuracy checks behind `lockstep check` and the test suite.

    specs.py            how each op's inputs are built (its harness spec, by op name)
    check.py            the row sweeps and the accuracy check of one op
    attention_check.py  attention's sweeps: chunked prefill, paged decode, ...
    masked_attention_check.py  masked attention's sweeps: padding on either side, decode, ...
    model_check.py      a whole model's sweeps and its float64 chain

`check(op, dtype)` runs the check that contract.toml's [ops] table names for an op; `checks_to_run`,
`setting` and `run_checks` are the sweep of `lockstep check` over many ops and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .. import contract, registry
from .attention_check import check_attention
from .check import OpReport, check_large, check_op, default_backend, num_threads
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


def checks_to_run(backend: str, names: list[str]) -> list[str]:
    """The harness checks to run on `backend`: `names` (check names) in their order, each once, or by
    default every check the backend implements (portable's, for a backend contract.toml does not
    list). Raises ValueError naming the ops that a named check needs and a listed backend lacks."""
    claimed = checks_of(backend) if backend in contract.load()["backends"] else None
    names = list(dict.fromkeys(names)) or claimed or checks_of("portable")
    if claimed is not None:
        missing = [op for n in names if n not in claimed for op in ops_of_check(n)
                   if op not in contract.backend_ops(backend)]
        if missing:
            raise ValueError(f"op: backend {backend!r} does not implement {missing}, which the requested "
                             f"checks need (contract.toml [backends.{backend}])")
    return names


def setting(backend: str, device: str) -> str:
    """Loads `backend` and says what the checks run on: "backend=native isa=avx2 threads=2
    torch=2.9.0", the line to compare between machines. The native backend's instruction set
    changes no bit, but it is the first thing to compare. Where the portable backend cannot be
    invariant on a CPU, the reason follows after "; ", at the thread count the sweeps run on.
    Raises registry.BackendUnavailable where the backend cannot run here."""
    registry.load(backend)
    isa = ""
    if backend == "native":
        from ..backends.native.build import isa_name, unbuilt_isas

        unbuilt = unbuilt_isas()
        isa = f" isa={isa_name()}" + (f" (the compiler left out {', '.join(unbuilt)})" if unbuilt else "")
    caveat = ""
    if backend == "portable" and device == "cpu":
        with num_threads(2):
            caveat = registry.portable_caveat()
    return (f"backend={backend}{isa} threads={torch.get_num_threads()} torch={torch.__version__}"
            + (f"; {caveat}" if caveat else ""))


def run_checks(names: list[str], dtypes: list[torch.dtype], backend: str, grad: bool = True, seed: int = 0,
               device: str = "cpu", large: bool = False,
               starting: Callable[[str, torch.dtype, int, int], None] | None = None) -> Iterator[OpReport]:
    """`check` of every name in every dtype, name by name, yielding each report as it finishes.
    `starting(name, dtype, i, n)` is called before the i-th of the n checks (from 0)."""
    todo = [(name, dtype) for name in names for dtype in dtypes]
    for i, (name, dtype) in enumerate(todo):
        if starting is not None:
            starting(name, dtype, i, len(todo))
        yield check(name, dtype, backend=backend, grad=grad, seed=seed, device=device, large=large)
