"""`lockstep gpu-audit` (every Triton kernel compiled for NVIDIA GPUs on this CPU, and audited) and
`lockstep bench` (op speed against eager PyTorch, as ratios)."""

from __future__ import annotations

import argparse

from .arguments import backend_name
from .output import require_extra


def cmd_gpu_audit(args: argparse.Namespace) -> int:
    """`lockstep gpu-audit`: gpu_audit.run's exit status."""
    require_extra("triton", "triton")
    from ..tools import gpu_audit

    return gpu_audit.run(args.arch, args.out, args.json, args.jobs, args.quiet)


def cmd_bench(args: argparse.Namespace) -> int:
    """`lockstep bench`: bench.main's exit status."""
    from ..tools import bench

    return bench.main(args.ops, quick=args.quick, out=args.markdown, backend=args.backend)


def add_gpu_audit(sub, formatter) -> None:
    a = sub.add_parser("gpu-audit", help="compile every Triton kernel to NVIDIA machine code (no GPU needed) and "
                                         "report registers, spills, shared memory, atomics and MMA instructions",
                       formatter_class=formatter)
    a.add_argument("--arch", default="sm_80,sm_90a,sm_100a", help="comma-separated: sm_80, sm_90a, sm_100a")
    a.add_argument("--out", default="gpu-audit", help="folder for the cubin and SASS files")
    a.add_argument("--json", metavar="PATH", help="write one record per kernel x configuration x architecture")
    a.add_argument("--jobs", type=int, default=None, help="compiler processes (default: one per core)")
    a.add_argument("--quiet", action="store_true", help="only the summary line")
    a.set_defaults(func=cmd_gpu_audit)


def add_bench(sub, formatter) -> None:
    b = sub.add_parser("bench", help="time ops against eager PyTorch and print ratios", formatter_class=formatter)
    b.add_argument("ops", nargs="*", help="ops to time (default: all)")
    b.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    b.add_argument("--markdown", metavar="PATH", help="append the table to a markdown file")
    b.add_argument("--backend", type=backend_name, default=None,
                   help="backend to time (default: the CPU's, native where it builds, else portable)")
    b.set_defaults(func=cmd_bench)
