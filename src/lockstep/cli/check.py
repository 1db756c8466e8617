"""`lockstep check` (each op against float64 and its invariance sweeps; --mode, the batch-invariant
mode's coverage) and `lockstep check-model` (a whole model's sweeps and its float64 chain)."""

from __future__ import annotations

import argparse
import math
import time
from typing import TYPE_CHECKING

import torch

from .. import contract
from .arguments import backend_name, check_name, dtype_list, model_arguments
from .output import LiveStatus, fmt, prepare_outputs, table, write_outputs

if TYPE_CHECKING:
    from ..harness import OpReport

HEADER = ["op", "dtype", "fwd max abs", "fwd max rel", "grad max abs", "err/eager", "accuracy", "sweeps", "invariance"]
WIDTHS = [17, 8, 11, 11, 12, 9, 8, 6, 10]


def _row(r: OpReport) -> str:
    a, fail = r.accuracy, r.first_failure
    # An exact op (no error at all) has no meaningful ratio to eager's error.
    ratio = "exact" if a.forward_max_abs == 0 else (
        f"{a.ratio_vs_eager:.2f}" if math.isfinite(a.ratio_vs_eager) else "inf")
    row = [r.op, r.dtype, fmt(a.forward_max_abs), fmt(a.forward_max_rel), fmt(a.gradient_max_abs), ratio,
           "pass" if a.passed else "FAIL", f"{sum(s.passed for s in r.sweeps)}/{len(r.sweeps)}",
           "pass" if r.invariant else f"FAIL {fail.sweep}: max diff {fmt(fail.max_diff)}"]
    return "  ".join(c.ljust(w) for c, w in zip(row, WIDTHS)).rstrip()


def cmd_check(args: argparse.Namespace) -> int:
    """`lockstep check`: one row per op and dtype; exit status 1 where one fails or the native bits
    are not the recorded ones."""
    if args.mode:
        return cmd_check_mode()
    from .. import harness

    backend = args.backend or harness.default_backend(args.device)
    names = harness.checks_to_run(backend, args.ops)
    prepare_outputs(args)
    print(f"lockstep check: {harness.setting(backend, args.device)}")
    native_bits = None
    status = LiveStatus()
    if backend == "native":
        from ..tools import backend_bits

        comparing = "comparing the native backend's bits with the recorded ones"

        def bits_line(line: str) -> None:
            status.say(line)
            status.show(comparing)

        status.show(comparing)
        native_bits = backend_bits.against_recording(log=bits_line)
        status.clear()
    print("  ".join(h.ljust(w) for h, w in zip(HEADER, WIDTHS)))
    print("  ".join("-" * w for w in WIDTHS))
    reports, failed, started = [], 0, time.time()

    def starting(name: str, dtype: torch.dtype, i: int, n: int) -> None:
        status.show(f"checking {name} {contract.dtype_name(dtype)} ({i + 1}/{n})")

    for r in harness.run_checks(names, args.dtype, backend, grad=not args.no_grad, seed=args.seed, device=args.device,
                                large=args.large, starting=starting if status.active else None):
        reports.append(r)
        status.say(_row(r))
        if args.verbose:
            for s in r.sweeps:
                print(f"  {r.op} {r.dtype} {s.sweep}: {'pass' if s.passed else 'FAIL'} "
                      f"(rows {s.compared}, max diff {fmt(s.max_diff)}) {s.detail}")
        failed += not r.passed
    bits_failed = bool(native_bits and native_bits["failed"])
    print(f"\n{len(reports) - failed} passed, {failed} failed ({time.time() - started:.1f}s)"
          + ("; the native bits are not the recorded ones (above)" if bits_failed else ""))
    data = {"backend": backend, "torch": torch.__version__, "reports": [r.to_dict() for r in reports]}
    if native_bits:
        data["native_bits"] = native_bits
    write_outputs(args, data, f"lockstep check (backend {backend})",
                  {"check": data["reports"], "native_bits": native_bits})
    return 1 if failed or bits_failed else 0


def cmd_check_mode() -> int:
    """`lockstep check --mode`: the coverage table; exit status 1 where a verified op fails."""
    from .. import mode

    rows = [[r["op"], r["status"], r["dtypes"], r["devices"], r["verified"], r["how"]] for r in mode.verify_coverage()]
    print("lockstep check --mode: lockstep.batch_invariant() coverage (verified: one row vs many, decode vs prefill)")
    print(table(["aten op", "status", "dtypes", "devices", "verified", "how"], rows))
    return 1 if any(r[4] == "FAIL" for r in rows) else 0


def cmd_check_model(args: argparse.Namespace) -> int:
    """`lockstep check-model`: one row per dtype; exit status 1 where one fails."""
    from ..harness.model_check import check_model, prompt_set
    from ..model import model_from_source

    failed, rows = 0, []
    for dtype in args.dtype:
        model = model_from_source(args.model, dtype, args.family, args.seed)
        report = check_model(model, prompt_set(model.config.vocab_size, args.seed))
        fail = next((s for s in report.sweeps if not s.passed), None)
        rows.append([report.dtype, f"{sum(s.passed for s in report.sweeps)}/{len(report.sweeps)}",
                     "pass" if fail is None else f"FAIL {fail.sweep}: max diff {fmt(fail.max_diff)}",
                     fmt(report.max_abs_dlogp_vs_float64), fmt(report.tolerance),
                     "pass" if report.passed else "FAIL"])
        failed += not report.passed
    print(f"lockstep check-model: {args.model} ({args.family if args.model == 'tiny' else 'checkpoint'})")
    print(table(["dtype", "sweeps", "invariance", "max |dlogp| vs float64", "contract", "result"], rows))
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def add_check(sub, formatter) -> None:
    c = sub.add_parser("check", help="accuracy against float64 and bitwise invariance sweeps for each op",
                       description="Accuracy against float64 and bitwise invariance sweeps for each op. On the "
                                   "native backend it first compares the kernels' bits, on every instruction set "
                                   "this CPU runs, and then the whole native backend's (ops, attention, the model's "
                                   "arithmetic, training), with those recorded in the package, whatever ops are "
                                   "named, and exits 1 where they differ (docs/adr/0026; the whole backend's only "
                                   "under a torch release the recording lists).",
                       formatter_class=formatter)
    c.add_argument("ops", nargs="*", type=check_name, help="ops to check (default: every op the backend implements)")
    c.add_argument("--dtype", type=dtype_list, default="fp32,bf16,fp16", help="comma-separated dtypes")
    c.add_argument("--backend", type=backend_name, default=None,
                   help="backend under test (default: the one lockstep runs on the device: native on a CPU where "
                        "it builds, else portable; triton on CUDA)")
    c.add_argument("--no-grad", action="store_true", help="forward only")
    c.add_argument("--no-large", dest="large", action="store_false",
                   help="skip the LLM-width sweep (65,536 columns, 152k vocabulary)")
    c.add_argument("--seed", type=int, default=0, help="seed of the generated inputs")
    c.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    c.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report")
    c.add_argument("-v", "--verbose", action="store_true", help="print every sweep")
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device of the op inputs (the triton backend runs under Triton's interpreter on cpu)")
    c.add_argument("--mode", action="store_true", help="print (and verify) the batch-invariant mode's coverage table")
    c.set_defaults(func=cmd_check)


def add_check_model(sub, formatter) -> None:
    m = sub.add_parser("check-model", help="model-level invariance and the float64 chain on a checkpoint",
                       formatter_class=formatter)
    model_arguments(m, default=None)
    m.add_argument("--dtype", type=dtype_list, default="fp32,bf16", help="comma-separated dtypes")
    m.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the tiny model")
    m.set_defaults(func=cmd_check_model)
