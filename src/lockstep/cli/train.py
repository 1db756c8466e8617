"""`lockstep train` (deterministic training with checkpoints and bitwise resume) and `lockstep rl`
(GRPO on a small task, its rollouts from `lockstep serve` over HTTP)."""

from __future__ import annotations

import argparse
import os
import sys

from .arguments import UsageError, backend_name, train_dtype
from .output import require_extra


def cmd_train(args: argparse.Namespace) -> int:
    """`lockstep train`: exit status 3 on a non-finite loss, 2 on bad input."""
    from .. import train

    cfg = train.TrainConfig(steps=args.steps, seq_len=args.seq_len, micro_batch_tokens=args.micro_batch_tokens,
                            accum=args.accum, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                            grad_clip=args.grad_clip, seed=args.seed, master_weights=args.master_weights,
                            save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
                            global_batch_tokens=args.global_batch_tokens, shard_optimizer=args.shard_optimizer)
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


def rl_defaults():
    """RLConfig's defaults, which `lockstep rl`'s flags show."""
    from ..rl import RLConfig

    return RLConfig()


def cmd_rl(args: argparse.Namespace) -> int:
    """`lockstep rl`: exit status 1 where lockstep's sampler-trainer mismatch is not exactly 0, or
    where every rollout server of several has stopped answering."""
    # The loop samples from `lockstep serve` over HTTP: its own servers unless --server names some.
    require_extra("rl", "httpx", *(() if args.server else ("fastapi", "uvicorn")))
    if args.server and args.servers != 1:
        raise UsageError(f"--servers {args.servers} starts servers and --server names running ones; give one "
                         "or the other")
    if args.servers < 1:
        raise UsageError(f"--servers: expected a positive int, got {args.servers}")
    if args.servers > 1 or len(args.server or []) > 1:       # several servers: SGLang's router in front
        require_extra("router", "sglang_router")
    if args.ray is None and (args.dp != 1 or args.ray_gpus or args.ray_cpus != 1):
        raise UsageError("--dp, --ray-cpus and --ray-gpus place the run on a Ray cluster: add --ray [ADDRESS] "
                         "(under torchrun, the data-parallel size is the number of processes)")
    if args.ray is not None:
        require_extra("ray", "ray")
        if args.server:
            raise UsageError("--ray places the rollout servers on the cluster (--servers N) and --server names "
                             "running ones; give one or the other")
        for flag, value in (("--dp", args.dp), ("--ray-cpus", args.ray_cpus)):
            if value < 1:
                raise UsageError(f"{flag}: expected a positive int, got {value}")
    from .. import rl
    from ..tools.report import from_run_dir

    cfg = rl.RLConfig(model=args.model, dtype=args.dtype, steps=args.steps, prompts_per_step=args.prompts_per_step,
                      group=args.group, max_new_tokens=args.max_new_tokens, temperature=args.temperature, lr=args.lr,
                      kl_coef=args.kl_coef, micro_batch_tokens=args.micro_batch_tokens,
                      max_num_seqs=args.max_num_seqs, save_every=args.save_every,
                      keep_checkpoints=args.keep_checkpoints, seed=args.seed, backend=args.backend,
                      shard_optimizer=args.shard_optimizer)
    try:
        if args.ray is not None:
            from ..rl import ray_run

            ray_run.run(cfg, args.out, address=args.ray, servers=args.servers, dp=args.dp, gpus=args.ray_gpus,
                        cpus_per_actor=args.ray_cpus, resume=args.resume, accept_mismatch=args.accept_mismatch,
                        push_weights=args.push_weights)
        else:
            rl.run(cfg, args.out, server_url=args.server, resume=args.resume, servers=args.servers,
                   accept_mismatch=args.accept_mismatch, push_weights=args.push_weights)
    except rl.NoServerLeft as e:
        print(f"lockstep rl: {e}; the last checkpoint is kept in {args.out}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:      # under torchrun, rank 0 writes the log and reports
        return 0
    s = rl.summary(args.out)
    print(f"lockstep rl: {s['steps']} steps; reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}; "
          f"sampler vs trainer: max |dlogp| {s['max_abs_dlogp']:.3g}, max approx KL {s['max_approx_kl0']:.3g}, "
          f"max |mean ratio - 1| {s['ratio_spread']:.3g}; report {from_run_dir(args.out)}")
    exact = s["max_abs_dlogp"] == 0 and s["max_approx_kl0"] == 0 and s["ratio_spread"] == 0
    return 0 if exact or args.backend == "eager" else 1


def add_train(sub, formatter) -> None:
    from ..train.trainer import TrainConfig

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
    t.add_argument("--shard-optimizer", action="store_true",
                   help="keep AdamW's state for each parameter element on one data-parallel rank (ZeRO stage 1; "
                        "changes no bit, and --resume may turn it on or off; nothing to shard at one rank)")
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


def add_rl(sub, formatter) -> None:
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
    g.add_argument("--shard-optimizer", action="store_true",
                   help="under torchrun, keep AdamW's state for each parameter element on one data-parallel rank "
                        "(ZeRO stage 1; changes no bit; nothing to shard at one rank)")
    g.add_argument("--backend", type=backend_name, default="auto",
                   help="op backend of trainer and server (eager: stock PyTorch, which shows the mismatch)")
    g.add_argument("--servers", type=int, default=1, metavar="N",
                   help="start N lockstep serve behind SGLang's router (the router extra), each step's prompts "
                        "shared among them; the run's bits are those of one server")
    g.add_argument("--server", metavar="URL", action="append",
                   help="use a running lockstep serve (it must hold the initial weights); given several times, "
                        "use them all behind a router started for the run")
    g.add_argument("--accept-mismatch", action="store_true",
                   help="sample from servers whose backend, CPU instruction set or GPU, torch or Triton version "
                        "differ from the trainer's (logged); without it they are refused")
    g.add_argument("--push-weights", choices=("auto", "disk", "http"), default="auto",
                   help="how each step's weights reach the servers: disk (they read the run folder: a shared "
                        "filesystem), http (the file travels in the request) or auto (http for a server on "
                        "another host)")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="place the run on a Ray cluster (the ray extra): the --servers rollout servers and the "
                        "--dp trainer ranks as Ray actors, with the bits of the run without Ray. ADDRESS: 'auto', "
                        "HOST:PORT of the cluster's head or ray://HOST:PORT; none: a cluster on this machine")
    g.add_argument("--dp", type=int, default=1, metavar="D",
                   help="with --ray, the trainer's data-parallel ranks (each a Ray actor); the run's bits do not "
                        "depend on it")
    g.add_argument("--ray-cpus", type=int, default=1, metavar="C",
                   help="with --ray, the CPUs of each rollout server and each trainer rank (their threads)")
    g.add_argument("--ray-gpus", action="store_true",
                   help="with --ray, also one GPU for each rollout server and each trainer rank: one actor per GPU "
                        "of GPU nodes")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    g.add_argument("--out", required=True, help="run folder: log.jsonl, rollouts.jsonl, checkpoints, report.html")
    g.set_defaults(func=cmd_rl)
