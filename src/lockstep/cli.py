"""The `lockstep` command line, a thin layer over the library.

    lockstep check [OP ...]      accuracy against float64 and bitwise invariance sweeps, op by op
    lockstep check --mode        the batch-invariant mode's coverage, each op verified
    lockstep check-model MODEL   a whole model's invariance sweeps and its float64 chain
    lockstep verify [MODEL]      the train-inference gate: engine logprobs == trainer logprobs
    lockstep train ...           deterministic training with checkpoints and bitwise resume
    lockstep parity ...          the first op where two runs diverge, or two training trajectories
    lockstep report RUN_DIR      one HTML page from the JSON files of a run folder
    lockstep serve [MODEL]       an OpenAI-compatible server (completions, chat, weight updates)
    lockstep convert GGUF DIR    a GGUF file's model as a Hugging Face folder
    lockstep gpu-audit           every Triton kernel compiled for NVIDIA GPUs on this CPU, and audited
    lockstep rl                  GRPO on a small task, rollouts through lockstep serve over HTTP
    lockstep bench [OP ...]      op speed against eager PyTorch, as ratios

MODEL is a local Hugging Face checkpoint folder or GGUF file, "smollm2" (SmolLM2-135M-Instruct, the
default of verify and serve) or "tiny" (a built-in random model). Each handler
parses, calls one library function and prints; bad arguments exit with status 2 and one line that
names the argument.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import sys
import time

import torch

from . import contract, registry
from .model.checkpoint import DEFAULT_MODEL

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")     # the keys of model.config.FAMILIES


class UsageError(Exception):
    """A bad argument: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse says "argument --backend: backend: unknown ..."; keep one naming of the argument.
        match = re.match(r"argument [^:]+: ([a-z_]+: .*)", message)
        raise UsageError(match.group(1) if match else message)


# --- argument types ----------------------------------------------------------------------------
def dtype_list(text: str) -> list[torch.dtype]:
    """"fp32,bf16" -> [torch.float32, torch.bfloat16]."""
    try:
        return [contract.parse_dtype(name) for name in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def backend_name(text: str) -> str:
    if text not in registry.available_backends():
        raise argparse.ArgumentTypeError(f"backend: unknown backend {text!r}; expected one of "
                                         f"{registry.available_backends()}")
    return text


def train_dtype(text: str) -> torch.dtype:
    dtype = dtype_list(text)
    if len(dtype) != 1 or dtype[0] not in (torch.float32, torch.bfloat16):
        raise argparse.ArgumentTypeError(f"dtype: expected fp32 or bf16 (bf16 with --master-weights for fp32 "
                                         f"master weights), got {text!r}")
    return dtype[0]


def check_name(text: str) -> str:
    known = list(contract.load()["ops"])
    if text not in known:
        raise argparse.ArgumentTypeError(f"op: unknown op {text!r}; expected one of {sorted(known)}")
    return contract.op_entry(text)["check"]


# --- shared output -----------------------------------------------------------------------------
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


def _require_extra(extra: str, *modules: str) -> None:
    """A UsageError that names the extra to install when one of `modules` is missing: the optional
    integrations are extras (pyproject.toml), and a command that needs one says so in one line."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise UsageError(f"needs the {extra} extra (pip install 'lockstep[{extra}]'): no module named {name!r}")


def _prepare_outputs(args: argparse.Namespace) -> None:
    """Create the folders of --json / --html before any work, so a long run never ends on a missing
    folder."""
    for path in (getattr(args, "json", None), getattr(args, "html", None)):
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                raise UsageError(f"{'json' if path == getattr(args, 'json', None) else 'html'}: cannot create "
                                 f"the folder of {path} ({e.strerror})") from None
            if not os.access(parent, os.W_OK):
                raise UsageError(f"output: {parent} is not writable")


def _write_outputs(args: argparse.Namespace, data: dict, title: str, sections: dict | None = None) -> None:
    """--json writes `data`; --html writes the self-contained report of `sections` (report.build_html's
    keys; by default `data` itself)."""
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)
    if getattr(args, "html", None):
        from .tools.report import write_html

        write_html(json.loads(json.dumps(data if sections is None else sections, default=str)), args.html, title)
        print(f"report: {args.html}")


# --- commands ----------------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> int:
    if args.mode:
        return cmd_check_mode()
    from . import harness

    if args.backend is None:
        args.backend = "triton" if str(args.device).startswith("cuda") else registry.cpu_backend()
    claimed = harness.checks_of(args.backend) if args.backend in contract.load()["backends"] else None
    names = list(dict.fromkeys(args.ops)) or claimed or harness.checks_of("portable")
    if claimed is not None:
        missing = [op for n in names if n not in claimed for op in harness.ops_of_check(n)
                   if op not in contract.backend_ops(args.backend)]
        if missing:
            raise UsageError(f"op: backend {args.backend!r} does not implement {missing}, which the requested "
                             f"checks need (contract.toml [backends.{args.backend}])")
    _prepare_outputs(args)
    header = ["op", "dtype", "fwd max abs", "fwd max rel", "grad max abs", "err/eager", "accuracy", "sweeps",
              "invariance"]
    widths = [17, 8, 11, 11, 12, 9, 8, 6, 10]
    registry.load(args.backend)
    # The instruction set changes no native bit, but it is the first thing to compare between machines.
    isa = ""
    if args.backend == "native":
        from .backends.native.build import isa_name, unbuilt_isas

        unbuilt = unbuilt_isas()
        isa = f" isa={isa_name()}" + (f" (the compiler left out {', '.join(unbuilt)})" if unbuilt else "")
    # Where the portable backend cannot be invariant, the failures below come with the reason, at
    # the thread count the sweeps run on.
    caveat = ""
    if args.backend == "portable" and args.device == "cpu":
        from .harness.check import num_threads

        with num_threads(2):
            caveat = registry.portable_caveat()
    print(f"lockstep check: backend={args.backend}{isa} threads={torch.get_num_threads()} torch={torch.__version__}"
          + (f"; {caveat}" if caveat else ""))
    native_bits = _compare_native_bits() if args.backend == "native" else None
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    reports, failed, started = [], 0, time.time()
    todo = [(name, dtype) for name in names for dtype in args.dtype]
    live = sys.stderr.isatty()
    for i, (name, dtype) in enumerate(todo):
        if live:
            print(f"\rchecking {name} {contract.dtype_name(dtype)} ({i + 1}/{len(todo)}, {time.time() - started:.0f}s)",
                  end="", file=sys.stderr, flush=True)
        r = harness.check(name, dtype, backend=args.backend, grad=not args.no_grad, seed=args.seed,
                          device=args.device, large=args.large)
        if live:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
        reports.append(r)
        a, fail = r.accuracy, r.first_failure
        # An exact op (no error at all) has no meaningful ratio to eager's error.
        ratio = "exact" if a.forward_max_abs == 0 else (
            f"{a.ratio_vs_eager:.2f}" if math.isfinite(a.ratio_vs_eager) else "inf")
        row = [r.op, r.dtype, _fmt(a.forward_max_abs), _fmt(a.forward_max_rel), _fmt(a.gradient_max_abs), ratio,
               "pass" if a.passed else "FAIL", f"{sum(s.passed for s in r.sweeps)}/{len(r.sweeps)}",
               "pass" if r.invariant else f"FAIL {fail.sweep}: max diff {_fmt(fail.max_diff)}"]
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), flush=True)
        if args.verbose:
            for s in r.sweeps:
                print(f"  {r.op} {r.dtype} {s.sweep}: {'pass' if s.passed else 'FAIL'} "
                      f"(rows {s.compared}, max diff {_fmt(s.max_diff)}) {s.detail}")
        failed += not r.passed
    bits_failed = bool(native_bits and native_bits["failed"])
    print(f"\n{len(reports) - failed} passed, {failed} failed ({time.time() - started:.1f}s)"
          + ("; the native bits are not the recorded ones (above)" if bits_failed else ""))
    data = {"backend": args.backend, "torch": torch.__version__, "reports": [r.to_dict() for r in reports]}
    if native_bits:
        data["native_bits"] = native_bits
    _write_outputs(args, data, f"lockstep check (backend {args.backend})",
                   {"check": data["reports"], "native_bits": native_bits})
    return 1 if failed or bits_failed else 0


def _compare_native_bits() -> dict:
    """Compare this machine's native bits with the recorded ones (docs/adr/0026), whatever ops were
    asked for, and print one line for each part: the kernels on every instruction set this CPU runs,
    then the whole backend (backend_bits: ops, attention, the model's arithmetic, training) on the
    instruction set in use. Returns {"recorded_on", "instruction_sets", "differ": {isa: kernel
    groups}, "backend": backend_bits.compare's result, "failed"}; a difference in the whole backend
    fails only where the inputs are the recording's (backend_bits.compare)."""
    from .tools import backend_bits
    from .backends.native import bits
    from .backends.native.build import isa_name
    from .tools.bench import machine

    recorded = bits.recorded()
    found, on = bits.compare(recorded["kernels"]), recorded["recorded_on"]
    differ = {isa: names for isa, names in found.items() if names}
    if differ:
        print(f"native bits: FAIL: {bits.mismatch(f'On this machine ({machine()}) the kernels', differ, on)}")
    else:
        print(f"native bits: the recorded ones on {', '.join(found)} (recorded on {on['machine']}, {on['isa']})")
    backend = backend_bits.compare(recorded)
    if not backend["differ"]:
        print(f"native backend bits: the recorded ones in all {backend['sections']} sections (ops forward and "
              f"backward, attention, the model's arithmetic, training) under torch {backend['torch']}")
    elif backend["counted"]:
        what = f"On this machine ({machine()}, torch {backend['torch']}) the native backend"
        print(f"native backend bits: FAIL: {bits.mismatch(what, {isa_name(): backend['differ']}, on)}")
    elif backend_bits.GENERATORS in backend["differ"]:
        print(f"native backend bits: other than the recorded ones in {len(backend['differ'])} of "
              f"{backend['sections']} sections, and torch's generators draw other numbers here than on "
              f"{on['machine']} (torch {backend['torch']} or this C library), so the inputs differ and this is not "
              "counted as a failure")
    else:
        print(f"native backend bits: other than the recorded ones in {', '.join(backend['differ'])} under torch "
              f"{backend['torch']}, which the recording does not list (torch {', '.join(recorded['torch'])}): its "
              "generators may draw other inputs, so this is not counted as a failure")
    return {"recorded_on": on, "instruction_sets": list(found), "differ": differ, "backend": backend,
            "failed": bool(differ) or backend["counted"]}


def cmd_check_mode() -> int:
    from . import mode

    rows = [[r["op"], r["status"], r["dtypes"], r["devices"], r["verified"], r["how"]] for r in mode.verify_coverage()]
    print("lockstep check --mode: lockstep.batch_invariant() coverage (verified: one row vs many, decode vs prefill)")
    print(_table(["aten op", "status", "dtypes", "devices", "verified", "how"], rows))
    return 1 if any(r[4] == "FAIL" for r in rows) else 0


def cmd_check_model(args: argparse.Namespace) -> int:
    from .harness.model_check import check_model, prompt_set
    from .model import model_from_source

    failed, rows = 0, []
    for dtype in args.dtype:
        model = model_from_source(args.model, dtype, args.family, args.seed)
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
    import dataclasses

    from .tools import batch_experiment, verify
    from .model import model_from_source

    _prepare_outputs(args)
    first = model_from_source(args.model, torch.float32, args.family, args.seed)     # a bad model fails here, first
    # A model with a chat template is a real one: its gate runs on its own chat prompts (short enough
    # for `make verify` on 2 cores), and the batch experiment follows.
    real = args.model != "tiny" and batch_experiment.has_chat_template(first)
    if args.model == "tiny":
        what = f"built-in tiny {args.family} model (random weights)"
    else:
        what = args.model + (" (SmolLM2-135M-Instruct, GGUF Q4_1)" if args.model == DEFAULT_MODEL else "")
    prompts = batch_experiment.chat_prompts(first)[:4] if real else None
    max_new_tokens = args.max_new_tokens or (8 if real else 16)
    print(f"lockstep verify: {what}; engine logprobs vs trainer logprobs (lockstep.logprobs)")
    dtypes = args.dtype or ([torch.bfloat16] if real else [torch.float32, torch.bfloat16])
    report = verify.run(lambda dtype: model_from_source(args.model, dtype, args.family, args.seed), dtypes,
                        prompts=prompts, max_new_tokens=max_new_tokens, seed=args.seed, with_eager=not args.no_eager)
    print("\nlockstep: 0 / 0 / 0 and identical tokens in every setting" if report.passed else
          "\nlockstep: FAILED (see the rows above)")
    out = {"model": args.model, "config": first.config.to_hf(), "verify": dataclasses.asdict(report)}
    if not real and args.model != "tiny":
        print("(no batch experiment: the model has no chat template)")
    if real and not args.no_experiment and importlib.util.find_spec("transformers") is None:
        print("\n(no batch experiment: it runs stock transformers beside lockstep, and transformers is not "
              "installed: pip install 'lockstep[hf]')")
    elif real and not args.no_experiment:
        print(f"\nThe batch experiment: one chat prompt, greedy (T = 0), {args.experiment_tokens} tokens, alone and "
              "inside batches of other chat prompts")
        experiment = batch_experiment.run(lambda dtype: model_from_source(args.model, dtype), torch.bfloat16,
                                          max_new_tokens=args.experiment_tokens)
        print("\n".join(batch_experiment.summary_lines(experiment)))
        out["experiment"] = dataclasses.asdict(experiment)
    _write_outputs(args, out, "lockstep verify")
    return 0 if report.passed else 1


def cmd_parity(args: argparse.Namespace) -> int:
    from . import parity
    from .model import model_from_source

    def make_model():
        return model_from_source(args.model, torch.float32, args.family, args.seed)

    if args.trajectory and "plain" in args.trajectory:
        _require_extra("hf", "transformers")
    _prepare_outputs(args)
    if args.trajectory:
        result = parity.trajectory_on_random_tokens(make_model, *args.trajectory, args.steps, args.seed)
        print(parity.format_trajectory(result))
        data, same = {"trajectory": result}, result["first_step_outside_contract"] is None
    else:
        a, b = parity.RunConfig.parse(args.a), parity.RunConfig.parse(args.b)
        comparison = parity.parity(make_model(), a, b, seed=args.seed)
        print(parity.format_comparison(comparison, str(a), str(b)))
        data, same = {"parity": {**comparison.to_dict(), "a": str(a), "b": str(b)}}, comparison.identical
    _write_outputs(args, data, "lockstep parity")
    return 0 if same else 1


def cmd_report(args: argparse.Namespace) -> int:
    from .tools.report import from_run_dir

    print(f"report: {from_run_dir(args.run_dir, args.out)}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from . import train

    cfg = train.TrainConfig(steps=args.steps, seq_len=args.seq_len, micro_batch_tokens=args.micro_batch_tokens,
                            accum=args.accum, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                            grad_clip=args.grad_clip, seed=args.seed, master_weights=args.master_weights,
                            save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
                            global_batch_tokens=args.global_batch_tokens)
    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    where = f"rank {rank}: " if rank is not None else ""
    try:
        summary = train.run(args.model, args.data, args.out, cfg, dtype=args.dtype, resume=args.resume,
                            overwrite=args.overwrite, tensor_parallel=args.tp)
    except train.NonFiniteLoss as e:
        print(f"\nlockstep train: {where}{e}; the last good checkpoint is kept in {args.out}", file=sys.stderr)
        return 3
    except (OSError, ValueError) as e:
        print(f"lockstep train: {where}{e}", file=sys.stderr)
        return 2
    if summary["rank"] != 0:
        return 0
    first, last = summary["first"], summary["last"]
    if first is None:
        print(f"lockstep train: already at step {summary['step']}; checkpoint {summary['checkpoint']}")
    else:
        print(f"lockstep train: {last['step']} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
              f"{summary['seconds']:.1f}s; checkpoint {summary['checkpoint']}; log {summary['log']}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    _require_extra("serve", "fastapi", "uvicorn")
    from . import server

    srv = server.build_server(args.model, args.dtype, args.family, args.seed, name=args.served_model_name,
                              backend=args.backend,
                              api_key=args.api_key or os.environ.get("LOCKSTEP_API_KEY"),
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              block_size=args.block_size, num_blocks=args.num_blocks,
                              prefix_caching=not args.no_prefix_caching)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not srv.api_key:
        print(f"lockstep serve: listening on {args.host} without --api-key: anyone who reaches it can use it",
              file=sys.stderr)
    print(f"lockstep serve: {srv.name} on http://{args.host}:{args.port} (weights version 0)", file=sys.stderr)
    server.serve(srv, args.host, args.port, args.log_level)
    return 0


def rl_defaults():
    from .rl import RLConfig

    return RLConfig()


def cmd_rl(args: argparse.Namespace) -> int:
    # The loop samples from `lockstep serve` over HTTP: its own server unless --server names one.
    _require_extra("rl", "httpx", *(() if args.server else ("fastapi", "uvicorn")))
    from . import rl
    from .tools.report import from_run_dir

    cfg = rl.RLConfig(model=args.model, dtype=args.dtype, steps=args.steps, prompts_per_step=args.prompts_per_step,
                      group=args.group, max_new_tokens=args.max_new_tokens, temperature=args.temperature, lr=args.lr,
                      kl_coef=args.kl_coef, micro_batch_tokens=args.micro_batch_tokens,
                      max_num_seqs=args.max_num_seqs, save_every=args.save_every,
                      keep_checkpoints=args.keep_checkpoints, seed=args.seed, backend=args.backend)
    rl.run(cfg, args.out, server_url=args.server, resume=args.resume)
    if int(os.environ.get("RANK", "0")) != 0:      # under torchrun, rank 0 writes the log and reports
        return 0
    s = rl.summary(args.out)
    print(f"lockstep rl: {s['steps']} steps; reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}; "
          f"sampler vs trainer: max |dlogp| {s['max_abs_dlogp']:.3g}, max approx KL {s['max_approx_kl0']:.3g}, "
          f"max |mean ratio - 1| {s['ratio_spread']:.3g}; report {from_run_dir(args.out)}")
    exact = s["max_abs_dlogp"] == 0 and s["max_approx_kl0"] == 0 and s["ratio_spread"] == 0
    return 0 if exact or args.backend == "eager" else 1


def serve_dtype(text: str) -> torch.dtype:
    dtype = dtype_list(text)
    if len(dtype) != 1:
        raise argparse.ArgumentTypeError(f"dtype: expected one dtype, got {text!r}")
    return dtype[0]


def cmd_convert(args: argparse.Namespace) -> int:
    from .model import convert_gguf

    convert_gguf(args.gguf, args.out)
    print(f"lockstep convert: wrote {args.out} (config.json, model.safetensors in float32, tokenizer.json, "
          "tokenizer_config.json)")
    return 0


def cmd_gpu_audit(args: argparse.Namespace) -> int:
    _require_extra("triton", "triton")
    from .tools import gpu_audit

    return gpu_audit.run(args.arch, args.out, args.json, args.jobs, args.quiet)


def cmd_bench(args: argparse.Namespace) -> int:
    from .tools import bench

    return bench.main(args.ops, quick=args.quick, out=args.markdown, backend=args.backend)


# --- the parser --------------------------------------------------------------------------------
def _model_arguments(p: argparse.ArgumentParser, default: str | None) -> None:
    if default is None:
        p.add_argument("model", help="a local Hugging Face checkpoint folder or GGUF file, 'smollm2' "
                                     "(SmolLM2-135M-Instruct, installed), or 'tiny' (a built-in random model)")
    else:
        p.add_argument("model", nargs="?", default=default,
                       help=f"a local checkpoint folder or GGUF file, 'smollm2' (SmolLM2-135M-Instruct, installed) or "
                            f"'tiny' (random weights); default: {default}")
    p.add_argument("--family", default="llama", choices=FAMILIES, help="family of the tiny model")


def _add_check(sub, formatter) -> None:
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


def _add_verify(sub, formatter) -> None:
    v = sub.add_parser("verify", help="the train-inference gate: engine logprobs == trainer logprobs, bitwise",
                       formatter_class=formatter)
    _model_arguments(v, default=DEFAULT_MODEL)
    v.add_argument("--dtype", type=dtype_list, default=None,
                   help="comma-separated dtypes (default: fp32,bf16 for tiny; bf16, the serving dtype, for a real model)")
    v.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated per prompt in the gate (default: 16 for tiny, 8 for a real model)")
    v.add_argument("--experiment-tokens", type=int, default=24,
                   help="tokens of each greedy completion in the batch experiment (real models)")
    v.add_argument("--no-experiment", action="store_true", help="only the gate, not the batch experiment")
    v.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sampling and the tiny model")
    v.add_argument("--no-eager", action="store_true", help="skip the plain-PyTorch comparison rows")
    v.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    v.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")
    v.set_defaults(func=cmd_verify)


def _add_train(sub, formatter) -> None:
    from .train.trainer import TrainConfig

    t = sub.add_parser("train", help="train a model on a text file or folder, deterministically", formatter_class=formatter,
                       description="Train with exact accumulation windows, AdamW, clipping and atomic checkpoints. "
                                   "Two runs with the same arguments give the same bits; --resume continues "
                                   "bitwise as if never interrupted. Under torchrun each data-parallel rank runs "
                                   "--accum micro-batches, so a step trains on ranks x accum x micro-batch-tokens "
                                   "tokens (or --global-batch-tokens). The layout (micro-batch size, accumulation, "
                                   "ranks, --tp) changes no bit of the run, and --resume may change it.")
    t.add_argument("--model", default="tiny", help="local checkpoint folder, or 'tiny' (random Llama-style model "
                                                   "with the built-in byte tokenizer)")
    t.add_argument("--data", required=True, help="a text file, or a folder of .txt/.md files")
    t.add_argument("--steps", type=int, default=100, help="optimizer steps (accumulation windows) to reach")
    t.add_argument("--seq-len", type=int, default=64, help="tokens per packed training sequence")
    t.add_argument("--micro-batch-tokens", type=int, default=256, help="tokens per micro-batch (whole sequences)")
    t.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step, per data-parallel rank")
    t.add_argument("--global-batch-tokens", type=int, default=0,
                   help="tokens per optimizer step across all ranks (a multiple of --seq-len; each rank runs the "
                        "micro-batches its share needs); 0: ranks x accum x micro-batch-tokens")
    t.add_argument("--tp", type=int, default=1, help="tensor-parallel size under torchrun (data-parallel size: "
                                                    "ranks / tp)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=10, help="linear warmup steps before the cosine decay")
    t.add_argument("--weight-decay", type=float, default=0.0, help="decoupled AdamW weight decay")
    t.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    t.add_argument("--dtype", type=train_dtype, default="fp32", help="compute dtype: fp32 or bf16")
    t.add_argument("--master-weights", action="store_true", help="keep fp32 master weights (for bf16 compute)")
    t.add_argument("--seed", type=int, default=0, help="seed of the data order and of the tiny model")
    t.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    t.add_argument("--keep-checkpoints", type=int, default=TrainConfig.keep_checkpoints,
                   help="keep the newest N checkpoints, deleting older ones once the new one is written (0: keep all)")
    t.add_argument("--out", required=True, help="output folder: checkpoints (step-N, latest) and log.jsonl")
    t.add_argument("--resume", action="store_true", help="continue from OUT/latest (the settings and the "
                                                         "window must be the run's own; --steps may grow, and the "
                                                         "layout may change: ranks, --tp, micro-batch size)")
    t.add_argument("--overwrite", action="store_true", help="start over in a non-empty OUT, deleting its run")
    t.set_defaults(func=cmd_train)


def _add_parity(sub, formatter) -> None:
    p_ = sub.add_parser("parity", help="find the first op where two runs diverge, or compare training trajectories "
                                       "(exit status 1 when they diverge)",
                        formatter_class=formatter,
                        description="Config: comma-separated backend=... (default auto: native on a CPU where "
                                    "it builds), layout=alone|batchN|chunkN|decode, dtype=fp32|bf16|fp16. "
                                    "Example: --a backend=eager --b backend=portable, or --a layout=alone --b "
                                    "layout=batch8. --trajectory A B compares two trainers (backend names, or 'plain' "
                                    "for the plain PyTorch trainer).")
    p_.add_argument("--a", default="backend=auto", help="config of run A")
    p_.add_argument("--b", default="backend=eager", help="config of run B")
    p_.add_argument("--trajectory", nargs=2, metavar=("A", "B"), help="compare two trainers instead")
    p_.add_argument("--steps", type=int, default=20, help="trajectory steps")
    p_.add_argument("--model", default="tiny", help="checkpoint folder or 'tiny'")
    p_.add_argument("--family", default="llama", choices=FAMILIES, help="family of the tiny model")
    p_.add_argument("--seed", type=int, default=0, help="seed of the data and of the tiny model")
    p_.add_argument("--json", metavar="PATH", help="write the comparison as JSON")
    p_.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")
    p_.set_defaults(func=cmd_parity)


def _add_report(sub, formatter) -> None:
    r = sub.add_parser("report", help="write one HTML report from the JSON files of a run folder")
    r.add_argument("run_dir", help="folder with check.json, verify.json, parity.json and/or trajectory.json")
    r.add_argument("--out", help="output path (default RUN_DIR/report.html)")
    r.set_defaults(func=cmd_report)


def _add_check_model(sub, formatter) -> None:
    m = sub.add_parser("check-model", help="model-level invariance and the float64 chain on a checkpoint",
                       formatter_class=formatter)
    _model_arguments(m, default=None)
    m.add_argument("--dtype", type=dtype_list, default="fp32,bf16", help="comma-separated dtypes")
    m.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the tiny model")
    m.set_defaults(func=cmd_check_model)


def _add_serve(sub, formatter) -> None:
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with weight updates", formatter_class=formatter,
                        description="Serve MODEL over OpenAI's completions and chat completions API. Every "
                                    "answer's logprobs equal the same request sent alone, and lockstep.logprobs "
                                    "on its tokens.")
    _model_arguments(sv, default=DEFAULT_MODEL)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (the default is this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on")
    sv.add_argument("--dtype", type=serve_dtype, default="bf16", help="compute dtype")
    sv.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    sv.add_argument("--served-model-name", help="the model name in the API (default: the folder's name)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or set LOCKSTEP_API_KEY)")
    sv.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    sv.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    sv.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    sv.add_argument("--num-blocks", type=int, help="KV-cache blocks (default: max-num-seqs full contexts)")
    sv.add_argument("--no-prefix-caching", action="store_true", help="do not share the blocks of equal prefixes")
    sv.add_argument("--backend", type=backend_name, default="auto", help="op backend (eager: stock PyTorch)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.set_defaults(func=cmd_serve)


def _add_rl(sub, formatter) -> None:
    g = sub.add_parser("rl", help="GRPO on the real model: rollouts from lockstep serve, updates through the Trainer",
                       formatter_class=formatter,
                       description="GRPO on generated arithmetic word problems (exact-match reward) with "
                                   "SmolLM2-135M-Instruct by default: rollouts from a `lockstep serve` (started for "
                                   "the run unless --server) over SGLang's /generate, the Trainer's step on the "
                                   "policy loss, new weights pushed with a new version after every step. Logs the "
                                   "reward and the sampler-trainer mismatch (exactly 0 with lockstep), writes "
                                   "OUT/rollouts.jsonl and OUT/report.html. Exits 1 if lockstep's mismatch is not "
                                   "exactly 0. Under torchrun, data parallel: rank 0 runs the server and "
                                   "broadcasts the rollouts, each rank trains its share, and the run's bits are "
                                   "those of one process.")
    defaults = rl_defaults()
    g.add_argument("--model", default=defaults.model, help="model to train and serve (a folder, a .gguf, 'smollm2' "
                                                           "or 'tiny')")
    g.add_argument("--dtype", choices=["bf16", "fp32"], default=defaults.dtype, help="compute dtype of trainer and server")
    g.add_argument("--steps", type=int, default=defaults.steps, help="GRPO steps")
    g.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step, help="problems per step")
    g.add_argument("--group", type=int, default=defaults.group, help="completions per problem (GRPO's group)")
    g.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, help="tokens per completion, at most")
    g.add_argument("--temperature", type=float, default=defaults.temperature, help="sampling temperature")
    g.add_argument("--lr", type=float, default=defaults.lr, help="AdamW learning rate (constant)")
    g.add_argument("--kl-coef", type=float, default=defaults.kl_coef, help="KL penalty to the initial model (0: none)")
    g.add_argument("--micro-batch-tokens", type=int, default=defaults.micro_batch_tokens,
                   help="tokens per micro-batch (the layout: the run's bits do not depend on it)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="completions the server decodes together (default: all of a step's; with lockstep the "
                        "run's bits do not depend on it)")
    g.add_argument("--save-every", type=int, default=defaults.save_every,
                   help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--keep-checkpoints", type=int, default=defaults.keep_checkpoints,
                   help="keep the newest N checkpoints, deleting older ones once the new one is written (0: keep all)")
    g.add_argument("--seed", type=int, default=defaults.seed, help="seed of the problems and the sampling")
    g.add_argument("--backend", type=backend_name, default="auto",
                   help="op backend of trainer and server (eager: stock PyTorch, which shows the mismatch)")
    g.add_argument("--server", metavar="URL", help="use a running lockstep serve (it must hold the initial weights)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    g.add_argument("--out", required=True, help="run folder: log.jsonl, rollouts.jsonl, checkpoints, report.html")
    g.set_defaults(func=cmd_rl)


def _add_convert(sub, formatter) -> None:
    cv = sub.add_parser("convert", help="write a GGUF file's model as a Hugging Face folder (safetensors, "
                                        "tokenizer, chat template) that lockstep and transformers load",
                        formatter_class=formatter)
    cv.add_argument("gguf", help="the .gguf file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K tensors)")
    cv.add_argument("out", help="the folder to write")
    cv.set_defaults(func=cmd_convert)


def _add_gpu_audit(sub, formatter) -> None:
    a = sub.add_parser("gpu-audit", help="compile every Triton kernel to NVIDIA machine code (no GPU needed) and "
                                         "report registers, spills, shared memory, atomics and MMA instructions",
                       formatter_class=formatter)
    a.add_argument("--arch", default="sm_80,sm_90a,sm_100a", help="comma-separated: sm_80, sm_90a, sm_100a")
    a.add_argument("--out", default="gpu-audit", help="folder for the cubin and SASS files")
    a.add_argument("--json", metavar="PATH", help="write one record per kernel x configuration x architecture")
    a.add_argument("--jobs", type=int, default=None, help="compiler processes (default: one per core)")
    a.add_argument("--quiet", action="store_true", help="only the summary line")
    a.set_defaults(func=cmd_gpu_audit)


def _add_bench(sub, formatter) -> None:
    b = sub.add_parser("bench", help="time ops against eager PyTorch and print ratios", formatter_class=formatter)
    b.add_argument("ops", nargs="*", help="ops to time (default: all)")
    b.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    b.add_argument("--markdown", metavar="PATH", help="append the table to a markdown file")
    b.add_argument("--backend", type=backend_name, default=None,
                   help="backend to time (default: the CPU's, native where it builds, else portable)")
    b.set_defaults(func=cmd_bench)


# One function per command, in the order `lockstep --help` lists them.
COMMANDS = (_add_check, _add_verify, _add_train, _add_parity, _add_report, _add_check_model, _add_serve, _add_rl,
            _add_convert, _add_gpu_audit, _add_bench)


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    p = _Parser(prog="lockstep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub, formatter)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(f"lockstep {command}: {e}".replace("lockstep : ", "lockstep: "), file=sys.stderr)
        return 2
    except (OSError, ValueError, registry.BackendUnavailable) as e:
        # Bad input found by the library (a missing folder, a malformed checkpoint, a bad config), or a
        # backend asked for that cannot run here.
        print(f"lockstep {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from .dist import RankZeroFailed     # under torchrun: rank 0 said why, the others say that it did

        if not isinstance(e, RankZeroFailed):
            raise
        print(f"lockstep {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
