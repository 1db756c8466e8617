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
import sys

from .. import registry
from .arguments import (FAMILIES, Parser, UsageError, backend_name, check_name, dtype_list, serve_dtype,
                        train_dtype)
from .check import add_check, add_check_model, cmd_check, cmd_check_mode, cmd_check_model
from .kernels import add_bench, add_gpu_audit, cmd_bench, cmd_gpu_audit
from .serve import add_convert, add_serve, cmd_convert, cmd_serve
from .train import add_rl, add_train, cmd_rl, cmd_train, rl_defaults
from .verify import add_parity, add_report, add_verify, cmd_parity, cmd_report, cmd_verify

# The docstring above is `lockstep --help`. Each command lives with its kin: arguments.py (the
# parser and the argument types), output.py (tables, --json, --html), check.py, verify.py (verify,
# parity, report), train.py (train, rl), serve.py (serve, convert), kernels.py (gpu-audit, bench).

__all__ = ["FAMILIES", "UsageError", "backend_name", "build_parser", "check_name", "cmd_bench", "cmd_check",
           "cmd_check_mode", "cmd_check_model", "cmd_convert", "cmd_gpu_audit", "cmd_parity", "cmd_report", "cmd_rl",
           "cmd_serve", "cmd_train", "cmd_verify", "dtype_list", "main", "rl_defaults", "serve_dtype", "train_dtype"]

# One function per command, in the order `lockstep --help` lists them.
COMMANDS = (add_check, add_verify, add_train, add_parity, add_report, add_check_model, add_serve, add_rl, add_convert,
            add_gpu_audit, add_bench)


def build_parser() -> argparse.ArgumentParser:
    """The `lockstep` parser: one subcommand per COMMANDS entry, each with its handler as `func`."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    p = Parser(prog="lockstep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in COMMANDS:
        add(sub, formatter)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command of `argv` (default sys.argv[1:]) and return its exit status: 2, after one line
    on stderr, for a bad argument or input."""
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
        from ..dist import RankZeroFailed     # under torchrun: rank 0 said why, the others say that it did

        if not isinstance(e, RankZeroFailed):
            raise
        print(f"lockstep {args.command}: {e}", file=sys.stderr)
        return 2

