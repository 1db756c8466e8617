"""The `lockstep` command line: `check` (accuracy + invariance) and `bench` (speed ratios)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from . import contract
from .backend import available_backends


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.2e}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def cmd_check_mode() -> int:
    """The batch-invariant mode's coverage table, each covered op verified (one row vs many)."""
    from . import batch_invariant as mode

    torch.manual_seed(0)
    x, w = torch.randn(40, 300), torch.randn(200, 300)
    q, k = torch.randn(2, 4, 17, 16), torch.randn(2, 2, 17, 16)
    probes = {
        "aten::mm": lambda t: t @ w.t(), "aten::addmm": lambda t: torch.nn.functional.linear(t, w, w[:, 0]),
        "aten::bmm": lambda t: torch.bmm(t[None], w.t()[None])[0],
        "aten::matmul / aten::linear": lambda t: torch.matmul(t, w.t()),
        "aten::_log_softmax (+ backward)": lambda t: torch.log_softmax(t, -1),
        "aten::_softmax (+ backward)": lambda t: torch.softmax(t, -1), "aten::softmax": lambda t: t.softmax(-1),
        "aten::silu (+ backward)": torch.nn.functional.silu, "aten::sum.dim_IntList": lambda t: t.sum(-1),
        "aten::mean.dim": lambda t: t.mean(-1),
        "aten::_fused_rms_norm (+ backward)": lambda t: torch.nn.functional.rms_norm(t, (300,), w[0], 1e-6),
    }
    rows = []
    with mode.batch_invariant():
        for row in mode.coverage():
            op, verified = row["op"], "-"
            if op in probes:
                fn = probes[op]
                verified = "pass" if torch.equal(fn(x[5:6])[0], fn(x)[5]) else "FAIL"
            elif op.startswith("aten::scaled_dot_product_attention"):
                full = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
                one = torch.nn.functional.scaled_dot_product_attention(q[:, :, 9:10], k[:, :, :10], k[:, :, :10],
                                                                       enable_gqa=True)
                verified = "pass" if torch.equal(one[:, :, 0], full[:, :, 9]) else "FAIL"
            rows.append([op, row["status"], row["dtypes"], row["devices"], verified, row["how"]])
    print("lockstep check --mode: lockstep.batch_invariant() coverage (verified: one row vs many, decode vs prefill)")
    print(_table(["aten op", "status", "dtypes", "devices", "verified", "how"], rows))
    return 1 if any(r[4] == "FAIL" for r in rows) else 0


def cmd_check(args: argparse.Namespace) -> int:
    if args.mode:
        return cmd_check_mode()
    from .harness import check as harness
    from .harness.attention_check import check_attention
    from .harness.specs import SPECS

    known = list(SPECS) + ["attention"]
    ops = args.ops or known
    for op in ops:
        if op not in known:
            print(f"lockstep check: op: unknown op {op!r}; expected one of {sorted(known)}", file=sys.stderr)
            return 2
    if args.backend not in available_backends():
        print(f"lockstep check: backend: unknown backend {args.backend!r}; expected one of {available_backends()}",
              file=sys.stderr)
        return 2
    try:
        dtypes = [contract.parse_dtype(d) for d in args.dtype.split(",")]
    except ValueError as e:
        print(f"lockstep check: {e}", file=sys.stderr)
        return 2

    reports, rows, failed = [], [], 0
    started = time.time()
    for op in ops:
        for dtype in dtypes:
            if op == "attention":
                r = check_attention(dtype, backend=args.backend, grad=not args.no_grad, seed=args.seed)
            else:
                r = harness.check_op(op, dtype, backend=args.backend, grad=not args.no_grad, seed=args.seed,
                                     device=args.device)
            if args.large and op in SPECS and SPECS[op].large:
                r.sweeps.append(harness.check_large(op, dtype, backend=args.backend, seed=args.seed))
            reports.append(r)
            a = r.accuracy
            fail = r.first_failure
            inv = "pass" if r.invariant else f"FAIL {fail.sweep}: max diff {_fmt(fail.max_diff)}"
            acc = "pass" if a.passed else "FAIL"
            rows.append([op, r.dtype, _fmt(a.forward_max_abs), _fmt(a.forward_max_rel), _fmt(a.gradient_max_abs),
                         f"{a.ratio_vs_eager:.2f}" if math.isfinite(a.ratio_vs_eager) else "inf",
                         acc, f"{sum(s.passed for s in r.sweeps)}/{len(r.sweeps)}", inv])
            failed += not r.passed
            if args.verbose:
                for s in r.sweeps:
                    print(f"  {op} {r.dtype} {s.sweep}: {'pass' if s.passed else 'FAIL'} "
                          f"(rows {s.compared}, max diff {_fmt(s.max_diff)}) {s.detail}")
    print(f"lockstep check: backend={args.backend} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(_table(["op", "dtype", "fwd max abs", "fwd max rel", "grad max abs", "err/eager", "accuracy",
                  "sweeps", "invariance"], rows))
    print(f"\n{len(reports) - failed} passed, {failed} failed ({time.time() - started:.1f}s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "torch": torch.__version__,
                       "reports": [r.to_dict() for r in reports]}, f, indent=1, default=str)
    if args.html:
        from .report import write_html

        write_html({"check": json.loads(json.dumps([r.to_dict() for r in reports], default=str))}, args.html,
                   f"lockstep check (backend {args.backend})")
        print(f"report: {args.html}")
    return 1 if failed else 0


def cmd_check_model(args: argparse.Namespace) -> int:
    from .harness.model_check import check_model, prompt_set
    from .model import ModelConfig, Transformer, load_model

    try:
        dtypes = [contract.parse_dtype(d) for d in args.dtype.split(",")]
    except ValueError as e:
        print(f"lockstep check-model: {e}", file=sys.stderr)
        return 2
    failed, rows = 0, []
    for dtype in dtypes:
        if args.model == "tiny":
            model = Transformer.from_config(ModelConfig.tiny(args.family), seed=args.seed, dtype=dtype)
        else:
            try:
                model = load_model(args.model, dtype=dtype)
            except (OSError, ValueError) as e:
                print(f"lockstep check-model: {e}", file=sys.stderr)
                return 2
        report = check_model(model, prompt_set(model.config.vocab_size, args.seed))
        fail = next((s for s in report.sweeps if not s.passed), None)
        rows.append([report.dtype, f"{sum(s.passed for s in report.sweeps)}/{len(report.sweeps)}",
                     "pass" if fail is None else f"FAIL {fail.sweep}: max diff {_fmt(fail.max_diff)}",
                     _fmt(report.max_abs_dlogp_vs_float64), _fmt(report.tolerance),
                     "pass" if report.passed else "FAIL"])
        failed += not report.passed
    print(f"lockstep check-model: {args.model} ({args.family if args.model == 'tiny' else 'checkpoint'})")
    print(_table(["dtype", "sweeps", "invariance", "max |dlogp| vs float64", "contract", "result"], rows))
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from . import verify
    from .model import ModelConfig, Transformer, load_model

    try:
        dtypes = [contract.parse_dtype(d) for d in args.dtype.split(",")]
    except ValueError as e:
        print(f"lockstep verify: {e}", file=sys.stderr)
        return 2
    if args.model == "tiny":
        def make(dtype):
            return Transformer.from_config(ModelConfig.tiny(args.family), seed=args.seed, dtype=dtype)
        what = f"built-in tiny {args.family} model (random weights)"
    else:
        try:
            load_model(args.model, dtype=torch.float32)
        except (OSError, ValueError) as e:
            print(f"lockstep verify: {e}", file=sys.stderr)
            return 2

        def make(dtype):
            return load_model(args.model, dtype=dtype)
        what = args.model
    print(f"lockstep verify: {what}; engine logprobs vs trainer logprobs (lockstep.logprobs)")
    report = verify.run(make, dtypes, max_new_tokens=args.max_new_tokens, seed=args.seed, with_eager=not args.no_eager)
    if args.json:
        verify.write_json(report, args.json)
    if args.html:
        import dataclasses

        from .report import write_html

        write_html({"verify": dataclasses.asdict(report)}, args.html, "lockstep verify")
        print(f"report: {args.html}")
    print("\nlockstep: 0 / 0 / 0 and identical tokens in every setting" if report.passed else
          "\nlockstep: FAILED (see the rows above)")
    return 0 if report.passed else 1


def cmd_parity(args: argparse.Namespace) -> int:
    from . import parity
    from .model import ModelConfig, Transformer, load_model

    def make_model():
        if args.model == "tiny":
            return Transformer.from_config(ModelConfig.tiny(args.family), seed=args.seed)
        return load_model(args.model, dtype=torch.float32)

    try:
        model = make_model()
        if args.trajectory:
            from .train import PackedDataset, TrainConfig, Trainer

            a_side, b_side = args.trajectory
            for side in (a_side, b_side):
                if side != "plain" and side not in available_backends():
                    raise ValueError(f"trajectory: unknown side {side!r}; expected 'plain' or a backend "
                                     f"{available_backends()}")
            tokens = torch.randint(0, model.config.vocab_size, (20000,),
                                   generator=torch.Generator().manual_seed(args.seed)).tolist()
            cfg = TrainConfig(steps=args.steps, seq_len=32, micro_batch_tokens=64, accum=2, lr=2e-3, warmup=2)

            def make_trainer():
                return Trainer(make_model(), PackedDataset(tokens, cfg.seq_len, cfg.micro_batch_tokens, args.seed), cfg)

            result = parity.compare_trajectories(make_trainer, a_side, b_side, args.steps)
            for r in result["rows"]:
                print(f"step {r['step']:3d}  loss {r['loss_a']:.6f} {r['loss_b']:.6f}  |dloss| {r['loss_diff']:.2e}  "
                      f"grad norm {r['grad_norm_a']:.4f} {r['grad_norm_b']:.4f}  max |dparam| {r['max_param_diff']:.2e}")
            first = result["first_step_outside_contract"]
            print(f"first step outside the contract (loss {result['loss_tol']}, params {result['param_tol']}): "
                  f"{first if first is not None else 'none'}")
            if result["first_diverging_op"]:
                c = result["first_diverging_op"]
                for phase in ("forward", "backward"):
                    d = c["first"][phase]
                    print(f"  at that step, {phase}: " + ("identical" if d is None else
                          f"first divergence {d['module'] or '<top>'} {d['op']} [{d['slot']}], max abs diff "
                          f"{d['max_abs_diff']:.3e}, max ulp diff {d['max_ulp_diff']}"))
            data = {"trajectory": result}
        else:
            a, b = parity.RunConfig.parse(args.a), parity.RunConfig.parse(args.b)
            comparison = parity.parity(model, a, b, seed=args.seed)
            print(parity.format_comparison(comparison, str(a), str(b)))
            data = {"parity": {**comparison.to_dict(), "a": str(a), "b": str(b)}}
    except (OSError, ValueError) as e:
        print(f"lockstep parity: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)
    if args.html:
        from .report import write_html

        write_html(data, args.html, "lockstep parity")
        print(f"report: {args.html}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import from_run_dir

    try:
        path = from_run_dir(args.run_dir, args.out)
    except (OSError, ValueError) as e:
        print(f"lockstep report: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .train import run_cli

    return run_cli(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args.ops, quick=args.quick, out=args.markdown)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lockstep", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="accuracy against float64 and bitwise invariance sweeps for each op")
    c.add_argument("ops", nargs="*", help="ops to check (default: all)")
    c.add_argument("--dtype", default="fp32,bf16,fp16", help="comma-separated dtypes (fp32, bf16, fp16, fp64)")
    c.add_argument("--backend", default="portable", help="backend under test (portable, eager, ...)")
    c.add_argument("--no-grad", action="store_true", help="forward only")
    c.add_argument("--no-large", dest="large", action="store_false",
                   help="skip the LLM-width sweep (65,536 columns, 152k vocabulary)")
    c.add_argument("--seed", type=int, default=0, help="seed of the generated inputs")
    c.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    c.add_argument("-v", "--verbose", action="store_true", help="print every sweep")
    c.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report")
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device of the op inputs (default: cuda when present; the triton backend runs under "
                        "Triton's interpreter on cpu)")
    c.add_argument("--mode", action="store_true", help="print (and verify) the batch-invariant mode's coverage table")
    c.set_defaults(func=cmd_check)

    v = sub.add_parser("verify", help="the train-inference gate: engine logprobs == trainer logprobs, bitwise")
    v.add_argument("model", nargs="?", default="tiny", help="a local checkpoint folder, or 'tiny' (default)")
    v.add_argument("--family", default="llama", help="family of the tiny model (llama, qwen2, qwen3)")
    v.add_argument("--dtype", default="fp32,bf16", help="comma-separated dtypes")
    v.add_argument("--max-new-tokens", type=int, default=16)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--no-eager", action="store_true", help="skip the plain-PyTorch comparison rows")
    v.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    v.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")
    v.set_defaults(func=cmd_verify)

    t = sub.add_parser("train", help="train a model on a text file or folder, deterministically",
                       description="Train with exact accumulation windows, AdamW, clipping and atomic checkpoints. "
                                   "Two runs with the same arguments give the same bits; --resume continues "
                                   "bitwise as if never interrupted.")
    t.add_argument("--model", default="tiny", help="local checkpoint folder, or 'tiny' (random Llama-style model "
                                                   "with the built-in byte tokenizer)")
    t.add_argument("--data", required=True, help="a text file, or a folder of .txt/.md files")
    t.add_argument("--steps", type=int, default=100, help="optimizer steps (accumulation windows) to reach")
    t.add_argument("--seq-len", type=int, default=64, help="tokens per packed training sequence")
    t.add_argument("--micro-batch-tokens", type=int, default=256, help="tokens per micro-batch (whole sequences)")
    t.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=10, help="linear warmup steps before the cosine decay")
    t.add_argument("--weight-decay", type=float, default=0.0, help="decoupled AdamW weight decay")
    t.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    t.add_argument("--dtype", default="fp32", help="compute dtype: fp32 or bf16")
    t.add_argument("--master-weights", action="store_true", help="keep fp32 master weights (for bf16 compute)")
    t.add_argument("--seed", type=int, default=0, help="seed of the data order and of the tiny model")
    t.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    t.add_argument("--out", required=True, help="output folder: checkpoints (step-N, latest) and log.jsonl")
    t.add_argument("--resume", action="store_true", help="continue from OUT/latest")
    t.set_defaults(func=cmd_train)

    p_ = sub.add_parser("parity", help="find the first op where two runs diverge, or compare training trajectories",
                        description="Config: comma-separated backend=..., layout=alone|batchN|chunkN|decode, "
                                    "dtype=fp32|bf16|fp16. Example: --a backend=eager --b backend=portable, or "
                                    "--a layout=alone --b layout=batch8. --trajectory A B compares two trainers "
                                    "(backend names, or 'plain' for the plain PyTorch trainer).")
    p_.add_argument("--a", default="backend=portable", help="config of run A")
    p_.add_argument("--b", default="backend=eager", help="config of run B")
    p_.add_argument("--trajectory", nargs=2, metavar=("A", "B"), help="compare two trainers instead")
    p_.add_argument("--steps", type=int, default=20, help="trajectory steps")
    p_.add_argument("--model", default="tiny", help="checkpoint folder or 'tiny'")
    p_.add_argument("--family", default="llama")
    p_.add_argument("--seed", type=int, default=0)
    p_.add_argument("--json", metavar="PATH")
    p_.add_argument("--html", metavar="PATH")
    p_.set_defaults(func=cmd_parity)

    r = sub.add_parser("report", help="write one HTML report from the JSON files of a run folder")
    r.add_argument("run_dir", help="folder with check.json, verify.json, parity.json and/or trajectory.json")
    r.add_argument("--out", help="output path (default RUN_DIR/report.html)")
    r.set_defaults(func=cmd_report)

    m = sub.add_parser("check-model", help="model-level invariance and the float64 chain on a checkpoint")
    m.add_argument("model", help="a local Hugging Face checkpoint folder, or 'tiny' for a built-in random model")
    m.add_argument("--family", default="llama", help="family of the tiny model (llama, qwen2, qwen3)")
    m.add_argument("--dtype", default="fp32,bf16", help="comma-separated dtypes")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_check_model)

    b = sub.add_parser("bench", help="time ops against eager PyTorch and print ratios")
    b.add_argument("ops", nargs="*", help="ops to time (default: all)")
    b.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    b.add_argument("--markdown", metavar="PATH", help="append the table to a markdown file")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
