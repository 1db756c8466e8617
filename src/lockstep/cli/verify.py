"""`lockstep verify` (the train-inference gate, and the batch experiment on a real model),
`lockstep parity` (the first op where two runs diverge, or two training trajectories) and
`lockstep report` (one HTML page from a run folder's JSON files)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import torch

from ..model.checkpoint import DEFAULT_MODEL
from .arguments import FAMILIES, dtype_list, model_arguments
from .output import LiveStatus, prepare_outputs, require_extra, write_outputs


def cmd_verify(args: argparse.Namespace) -> int:
    """`lockstep verify`: the gate, then the batch experiment on a model with a chat template; exit
    status 1 where the gate fails."""
    from ..model import model_from_source
    from ..tools import batch_experiment, verify

    prepare_outputs(args)
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
    status = LiveStatus()
    report = verify.run(lambda dtype: model_from_source(args.model, dtype, args.family, args.seed), dtypes,
                        prompts=prompts, max_new_tokens=max_new_tokens, seed=args.seed, with_eager=not args.no_eager,
                        log=status.say, progress=status.show)
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
                                          max_new_tokens=args.experiment_tokens, log=status.say, progress=status.show)
        print("\n".join(batch_experiment.summary_lines(experiment)))
        out["experiment"] = dataclasses.asdict(experiment)
    write_outputs(args, out, "lockstep verify")
    return 0 if report.passed else 1


def cmd_parity(args: argparse.Namespace) -> int:
    """`lockstep parity`: exit status 1 where the two runs or trajectories diverge."""
    from .. import parity
    from ..model import model_from_source

    def make_model():
        return model_from_source(args.model, torch.float32, args.family, args.seed)

    if args.trajectory and "plain" in args.trajectory:
        require_extra("hf", "transformers")
    prepare_outputs(args)
    if args.trajectory:
        result = parity.trajectory_on_random_tokens(make_model, *args.trajectory, args.steps, args.seed)
        print(parity.format_trajectory(result))
        data, same = {"trajectory": result}, result["first_step_outside_contract"] is None
    else:
        a, b = parity.RunConfig.parse(args.a), parity.RunConfig.parse(args.b)
        comparison = parity.parity(make_model(), a, b, seed=args.seed)
        print(parity.format_comparison(comparison, str(a), str(b)))
        data, same = {"parity": {**comparison.to_dict(), "a": str(a), "b": str(b)}}, comparison.identical
    write_outputs(args, data, "lockstep parity")
    return 0 if same else 1


def cmd_report(args: argparse.Namespace) -> int:
    """`lockstep report`: the HTML page of a run folder."""
    from ..tools.report import from_run_dir

    print(f"report: {from_run_dir(args.run_dir, args.out)}")
    return 0


def add_verify(sub, formatter) -> None:
    v = sub.add_parser("verify", help="the train-inference gate: engine logprobs == trainer logprobs, bitwise",
                       formatter_class=formatter)
    model_arguments(v, default=DEFAULT_MODEL)
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


def add_parity(sub, formatter) -> None:
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


def add_report(sub, formatter) -> None:
    r = sub.add_parser("report", help="write one HTML report from the JSON files of a run folder")
    r.add_argument("run_dir", help="folder with check.json, verify.json, parity.json and/or trajectory.json")
    r.add_argument("--out", help="output path (default RUN_DIR/report.html)")
    r.set_defaults(func=cmd_report)
