"""lockstep.rl: GRPO with rollouts from `lockstep serve` and updates through lockstep's Trainer.

Each step:
1. the step's problems (lockstep.rl.task; drawn from the seed and the step alone, so a resumed run
   draws the same ones), as chat prompts;
2. rollouts from a `lockstep serve` over HTTP (lockstep.rl.rollout), or from several behind SGLang's
   router (lockstep.rl.servers): n completions per prompt, seeded sampling, with the sampler's
   logprobs and the weight version that sampled;
3. rewards and advantages normalized within each prompt's group;
4. the Trainer's step (lockstep.train.Trainer.step) on the policy loss (lockstep.train.PolicyLoss):
   the same accumulation windows, clipping, AdamW, checkpoints and layout invariance as supervised
   training;
5. the new weights pushed to the server (to every server) with the next weight version, which the
   next rollouts must carry (SGLang's weight_version label, "step-N").

Every step's record has the reward and lockstep.mismatch's metrics between the sampler's logprobs
and the ones the trainer computed: with lockstep they are the same bits, so max |dlogp| 0, approx
KL 0 and a mean ratio of exactly 1. On the eager backend (stock PyTorch in server and trainer) they
are not.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import torch

from .. import checks
from ..machine import check_ranks, fingerprint
from ..mismatch import mismatch
from ..model import Transformer, logprobs, model_from_source, with_byte_tokenizer
from ..registry import use_backend
from ..train import PolicyLoss, TrainConfig, Trainer, read_log, truncate_log
from .rollout import PUSHES, RolloutClient, Rollout
from .servers import FingerprintMismatch, NoServerLeft, ServerPool, connect
from .task import ArithmeticTask, Problem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class RLConfig:
    model: str = "smollm2"          # what `lockstep serve` and load_model take; "tiny" for tests
    dtype: str = "bf16"
    steps: int = 30
    prompts_per_step: int = 8
    group: int = 8                  # completions per prompt (GRPO's group)
    max_new_tokens: int = 24
    temperature: float = 1.0
    lr: float = 5e-5                # the SmolLM2 run of docs/rl.md: reward 0.06 -> 0.88 in 30 steps
    clip: float = 0.2
    kl_coef: float = 0.0            # > 0: a KL penalty to the frozen initial model
    loss_mean: str = "token"        # "token" or "sequence"
    micro_batch_tokens: int = 4096  # the layout: changes no bit of the run
    max_num_seqs: int | None = None  # completions the server decodes together (None: all of a step's)
    save_every: int = 1
    keep_checkpoints: int = 2       # a SmolLM2 checkpoint with fp32 master weights and AdamW is 1.8 GB
    seed: int = 0
    backend: str = "auto"           # of the trainer and the server; "eager" shows the mismatch
    shard_optimizer: bool = False   # AdamW's state on one data-parallel rank per element (docs/adr/0037)

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch_tokens"):
            checks.int_at_least(name, getattr(self, name))
        checks.int_at_least("save_every", self.save_every, 0)
        checks.int_at_least("keep_checkpoints", self.keep_checkpoints, 0)
        if self.max_num_seqs is not None:
            checks.int_at_least("max_num_seqs", self.max_num_seqs)
        if checks.int_at_least("group", self.group) < 2:
            raise ValueError(f"group: expected at least 2 completions per prompt (GRPO compares them), got {self.group}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature: expected a positive number, got {self.temperature!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: expected a positive number, got {self.lr!r}")

    def train_config(self) -> TrainConfig:
        """The Trainer's settings: constant learning rate, global-norm clipping at 1, fp32 master
        weights when the model computes in bf16."""
        return TrainConfig(steps=self.steps, seq_len=2, micro_batch_tokens=self.micro_batch_tokens, lr=self.lr,
                           warmup=0, min_lr_ratio=1.0, betas=(0.9, 0.99), grad_clip=1.0, seed=self.seed,
                           master_weights=self.dtype != "fp32", save_every=self.save_every,
                           keep_checkpoints=self.keep_checkpoints, shard_optimizer=self.shard_optimizer)


# What a resumed run may change: how long it runs and what it keeps on disk.
RESUMABLE = ("steps", "save_every", "keep_checkpoints", "shard_optimizer")


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """(r - mean) / (std + 1e-6) within each group of `group` consecutive rewards, in float64. The
    sums are math.fsum's, correctly rounded, so the bits are the same on every machine (ATen's mean
    and std reduce in an order of its vector kernels)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or len(rewards) % group:
        raise ValueError(f"group: expected a positive int that divides the {len(rewards)} rewards, got {group!r}")
    out = []
    for start in range(0, len(rewards), group):
        r = [float(x) for x in rewards[start:start + group]]
        mean = math.fsum(r) / group
        std = math.sqrt(math.fsum((x - mean) * (x - mean) for x in r) / group)
        out += [(x - mean) / (std + 1e-6) for x in r]
    return out


def prompt_ids(tokenizer, problem: Problem) -> list[int]:
    """A problem as the model's chat prompt (its chat template), or as plain text for a model without one."""
    from ..model.chat_template import ChatTemplate

    template = ChatTemplate.for_tokenizer(tokenizer)
    if template is None:
        return tokenizer.encode(f"Q: {problem.question}\nA:")
    return tokenizer.encode(template.render(problem.messages))


def rollout_window(prompts: list[list[int]], rollouts: list[Rollout], advantages: list[float], cfg: RLConfig
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], PolicyLoss]:
    """The Trainer's window for a step's rollouts: prompt + completion per rollout, the completion's
    targets trained, and the policy loss over them with the sampler's logprobs."""
    sequences, masks, sampled = [], [], []
    for r in rollouts:
        prompt = prompts[r.prompt_index]
        seq = torch.tensor(prompt + r.token_ids, dtype=torch.int64)
        mask = torch.zeros(seq.numel() - 1, dtype=torch.bool)
        mask[len(prompt) - 1:] = True
        old = torch.zeros(seq.numel() - 1, dtype=torch.float32)
        old[len(prompt) - 1:] = torch.tensor(r.logprobs, dtype=torch.float32)
        sequences.append(seq)
        masks.append(mask)
        sampled.append(old)
    loss = PolicyLoss(sampled, advantages, clip=cfg.clip, mean=cfg.loss_mean, temperature=cfg.temperature)
    return sequences, masks, loss


def run(cfg: RLConfig, out: str, task: ArithmeticTask | None = None, server_url: str | list[str] | None = None,
        resume: bool = False, progress: bool = True, servers: int = 1, accept_mismatch: bool = False,
        push_weights: str = "auto", placement: dict | None = None) -> list[dict]:
    """GRPO for cfg.steps steps with rollouts from a `lockstep serve` (started here unless server_url
    is given). With `servers` > 1, that many servers are started behind SGLang's router, and several
    URLs in server_url are servers already running, behind a router started here
    (lockstep.rl.servers); either way the run has the bits of one server. Every server's fingerprint,
    and under torchrun every rank's, must be rank 0's (lockstep.machine) unless accept_mismatch.
    push_weights: how each step's weights reach the servers (rollout.PUSHES: "disk", a path they
    read; "http", the file in the request; "auto", http for a server on another host). Writes
    out/log.jsonl (one record a step, after a start event with the run's settings), out/rollouts.jsonl
    (every problem, completion and reward), checkpoints in out/checkpoints and the served weights in
    out/weights. `resume` continues the run in `out` from its last checkpoint, bitwise as if it had
    not stopped. placement: where a cluster placed the servers and ranks (lockstep.rl.ray_run), kept
    in the start event.

    Under torchrun, data parallel: rank 0 owns the folder and the server and broadcasts each step's
    rollouts; every rank trains its share of the window (lockstep.dist.ParallelSync), and the run's
    bits are those of one process. Returns the step records (on rank 0; [] on the others)."""
    from .. import dist as ldist

    checks.int_at_least("servers", servers)
    checks.one_of("push_weights", push_weights, PUSHES)
    distributed = ldist.init_from_env()
    try:
        urls = [server_url] if isinstance(server_url, str) else list(server_url or [])
        return _run(cfg, out, task or ArithmeticTask(), urls, resume, progress, distributed, servers, accept_mismatch,
                    push_weights, placement)
    finally:
        if distributed:
            torch.distributed.destroy_process_group()


def _check_out(out: str, resume: bool) -> None:
    ckpt_dir = os.path.join(out, "checkpoints")
    if resume and not os.path.exists(os.path.join(ckpt_dir, "latest")):
        raise FileNotFoundError(f"resume: no checkpoint in {ckpt_dir}; start the run without --resume")
    if not resume and os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"out: {out} is not empty; pass --resume to continue the run in it, or choose another folder")
    os.makedirs(out, exist_ok=True)


def _run(cfg: RLConfig, out: str, task: ArithmeticTask, urls: list[str], resume: bool, progress: bool,
         distributed: bool, servers: int, accept_mismatch: bool, push_weights: str = "auto",
         placement: dict | None = None) -> list[dict]:
    from .. import dist as ldist

    cfg.validate()
    lead = not distributed or torch.distributed.get_rank() == 0
    dtype = DTYPES[cfg.dtype]
    ckpt_dir = os.path.join(out, "checkpoints")
    ldist.from_rank0(lambda: _check_out(out, resume), "out")
    model = with_byte_tokenizer(model_from_source(cfg.model, dtype, "llama", cfg.seed, vocab_size=320))
    sync = None
    if distributed:
        ldist.check_consistent(model, asdict(cfg))
        sync = ldist.ParallelSync(model)
    trainer = Trainer(model, None, cfg.train_config(), sync, layout_invariant=cfg.backend not in ("eager", "reference"))
    reference = None
    if cfg.kl_coef:                                  # the frozen initial model
        reference = model_from_source(cfg.model, dtype, "llama", cfg.seed, vocab_size=320).requires_grad_(False)
    if resume:
        trainer.resume(ckpt_dir)
        before = trainer.resumed_extra.get("config", {})
        changed = sorted(k for k, v in asdict(cfg).items() if k in before and before[k] != v and k not in RESUMABLE)
        if changed:
            raise ValueError(f"resume: the run in {out} was started with other settings ({', '.join(changed)}); "
                             "a resumed run keeps them (only --steps, --save-every, --keep-checkpoints and "
                             "--shard-optimizer may change)")
    log_path = os.path.join(out, "log.jsonl")
    client: RolloutClient | ServerPool | None = None
    ranks = check_ranks(lambda: fingerprint(cfg.backend, model.device), accept_mismatch)

    def start_server() -> str:
        nonlocal client
        weights = push_folder(out, trainer)
        client = connect(urls, servers, ranks[0], accept_mismatch, model=weights,
                         dtype=cfg.dtype, backend=cfg.backend, push=push_weights,
                         max_num_seqs=cfg.max_num_seqs or cfg.prompts_per_step * cfg.group)
        return client.update_weights(weights, f"step-{trainer.step_idx}")

    def push() -> str:
        return client.update_weights(push_folder(out, trainer), f"step-{trainer.step_idx}")

    records: list[dict] = []
    log = data = None
    try:
        version = ldist.from_rank0(start_server, "rollout server")
        if lead:
            dropped = truncate_log(log_path, trainer.step_idx) if resume else 0
            truncate_log(os.path.join(out, "rollouts.jsonl"), trainer.step_idx) if resume else None
            log, data = open(log_path, "a"), open(os.path.join(out, "rollouts.jsonl"), "a")
            log.write(json.dumps({"event": "resume" if resume else "start", "step": trainer.step_idx,
                                  "config": asdict(cfg), "server": client.url,
                                  "servers": client.server_urls, "ranks": trainer.sync.world,
                                  "layout": trainer.layout,
                                  "fingerprints": {"ranks": ranks, "servers": client.fingerprints},
                                  "push_weights": push_weights, "placement": placement,
                                  "dropped_log_records": dropped}) + "\n")
        served_before: dict[str, int] = {}
        with use_backend(cfg.backend):
            while trainer.step_idx < cfg.steps:
                rec, rows = rl_step(trainer, client, task, cfg, model.tokenizer, version, reference)
                if lead and isinstance(client, ServerPool):      # how the router shared the step
                    served, before = client.served(), served_before
                    rec["served"] = {url: n - before.get(url, 0) for url, n in served.items()}
                    served_before = served
                version = rec["weight_version"] = ldist.from_rank0(push, "weight push")
                if cfg.save_every and trainer.step_idx % cfg.save_every == 0 or trainer.step_idx == cfg.steps:
                    trainer.save(ckpt_dir, extra={"config": asdict(cfg)})
                if not lead:
                    continue
                data.writelines(json.dumps(r) + "\n" for r in rows)
                data.flush()
                log.write(json.dumps(rec) + "\n")
                log.flush()
                records.append(rec)
                if progress:
                    print(f"step {rec['step']:3d}  reward {rec['reward']:.3f}  max|dlogp| {rec['max_abs_dlogp']:.3g}  "
                          f"approx KL {rec['approx_kl0']:.3g}  mean ratio {rec['mean_ratio']:.9f}  "
                          f"({rec['seconds']:.0f} s)", file=sys.stderr)
    finally:
        for f in (log, data):
            if f is not None:
                f.close()
        if client is not None:
            client.close()
    return records


def rl_step(trainer: Trainer, client: RolloutClient | None, task: ArithmeticTask, cfg: RLConfig, tokenizer,
            version: str, reference: Transformer | None = None) -> tuple[dict, list[dict]]:
    """One GRPO step (rollouts, rewards, the Trainer's update); returns its log record and the
    rollouts' records. `version`: the weight version the server must sample with (the trainer's
    current weights); `reference`: the frozen model of the KL penalty (cfg.kl_coef > 0). Under
    torchrun, rank 0 samples (`client`; None on the other ranks) and broadcasts the rollouts, and
    the record's mismatch covers every rank's sequences."""
    from .. import dist as ldist

    started = time.time()
    step = trainer.step_idx + 1
    problems = task.problems(cfg.prompts_per_step, random.Random(cfg.seed * 1_000_003 + step))
    prompts = [prompt_ids(tokenizer, p) for p in problems]

    def sample() -> list[Rollout]:
        rollouts = client.generate(prompts, cfg.group, cfg.max_new_tokens, cfg.temperature,
                                   seed=cfg.seed * 1_000_003 + step)
        stale = {r.weight_version for r in rollouts} - {version}
        if stale:
            raise RuntimeError(f"rollout: sampled with weight version {sorted(stale)}, the trainer's weights are "
                               f"version {version}")
        return rollouts

    rollouts = ldist.from_rank0(sample, "rollout")
    rewards = [task.reward(problems[r.prompt_index], r.text) for r in rollouts]
    advantages = group_advantages(rewards, cfg.group)
    sequences, masks, loss = rollout_window(prompts, rollouts, advantages, cfg)
    if reference is not None:
        with torch.no_grad():
            loss.ref_logprobs = logprobs(reference, sequences, cfg.temperature)
        loss.kl_coef = cfg.kl_coef
    if not any(bool(m.any()) for m in masks):
        raise RuntimeError("rollout: every completion is empty; nothing to train")
    rec = trainer.step(sequences, masks, loss)
    seen = loss.trainer_logprobs
    if trainer.sync.world > 1:                       # each rank saw its share of the sequences
        shares: list = [None] * trainer.sync.world
        torch.distributed.all_gather_object(shares, seen)
        seen = {i: t for share in shares for i, t in share.items()}
    trained = torch.cat([seen[i][m] for i, m in enumerate(masks)])
    sampled = torch.cat([s[m] for s, m in zip(loss.sampler_logprobs, masks)])
    rec.update({"reward": sum(rewards) / len(rewards), **mismatch(trained, sampled),
                "sampled_with_version": version, "seconds": round(time.time() - started, 3)})
    rows = [{"step": step, **task.to_record(problems[r.prompt_index], r.text, reward), "tokens": len(r.token_ids),
             "finish_reason": r.finish_reason} for r, reward in zip(rollouts, rewards)]
    return rec, rows


def push_folder(out: str, trainer: Trainer) -> str:
    """The trainer's current weights as a model folder (out/weights/step-N) for the server to load;
    the folder of the step before is removed."""
    root = os.path.join(out, "weights")
    path = os.path.join(root, f"step-{trainer.step_idx:06d}")
    trainer.model.save(path)
    for name in os.listdir(root):
        if name != os.path.basename(path):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return path


def summary(out: str) -> dict:
    """The run's first and last rewards (the mean of the first and last quarter of its steps) and its
    worst mismatch (from out/log.jsonl)."""
    steps, _ = read_log(out)
    if not steps:
        raise ValueError(f"summary: {out}/log.jsonl holds no step")
    k = max(1, len(steps) // 4)
    return {"steps": len(steps), "reward_first": sum(r["reward"] for r in steps[:k]) / k,
            "reward_last": sum(r["reward"] for r in steps[-k:]) / k,
            "max_abs_dlogp": max(r["max_abs_dlogp"] for r in steps), "max_approx_kl0": max(r["approx_kl0"] for r in steps),
            "ratio_spread": max(abs(r["mean_ratio"] - 1) for r in steps)}
