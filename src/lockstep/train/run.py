"""lockstep.train.run: `lockstep train`: a model and a text, a run folder, steps, a JSONL log and
checkpoints, under torchrun when there are several processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict

import torch

from .. import checks
from ..model import Transformer, model_from_source, with_byte_tokenizer
from .data import PackedDataset, read_texts
from .trainer import TrainConfig, Trainer


def make_model_and_tokens(model_arg: str, data_path: str, dtype: torch.dtype, seed: int) -> tuple[Transformer, list[int]]:
    """Load (or build the tiny) model and tokenize the data; token ids beyond the vocab are refused."""
    model = with_byte_tokenizer(model_from_source(model_arg, dtype, "llama", seed, vocab_size=320))
    tokenizer = model.tokenizer
    texts = read_texts(data_path)
    tokens: list[int] = []
    for t in texts:
        ids = tokenizer.encode(t)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.append(tokenizer.eos_token_id)
        tokens.extend(ids)
    too_big = [t for t in tokens if t >= model.config.vocab_size]
    if too_big:
        raise ValueError(f"data: the tokenizer produces id {max(too_big)}, beyond the model's vocabulary of "
                         f"{model.config.vocab_size} (tokenizer/model mismatch); refusing to train")
    return model, tokens


# What `lockstep train` writes into its output folder (and all that --overwrite may delete).
RUN_FILES = re.compile(r"(step-\d{6}|\.tmp-step-\d{6}(-\d+)?|latest|\.latest\.tmp|log\.jsonl(\.tmp)?|\.log-rank\d+\.jsonl)")


def prepare_out(out: str, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run in a folder that holds one, unless `overwrite` (which deletes only
    what a run writes, and refuses a folder that holds anything else)."""
    if resume or not os.path.isdir(out) or not os.listdir(out):
        return
    entries = sorted(os.listdir(out))
    if not overwrite:
        raise ValueError(f"out: {out} is not empty ({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''}); "
                         "pass --resume to continue the run in it, or --overwrite to start over")
    foreign = [e for e in entries if not RUN_FILES.fullmatch(e)]
    if foreign:
        raise ValueError(f"out: {out} holds files that lockstep train did not write ({', '.join(foreign[:4])}); "
                         "refusing to overwrite it")
    for e in entries:
        path = os.path.join(out, e)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def read_log(out: str) -> tuple[list[dict], list[dict]]:
    """A run folder's log.jsonl as (step records, event records): one step record per optimizer step
    (step, loss, grad_norm, lr, tokens, seconds) and an event record at each start and resume
    (ranks, accum, global batch, layout, the settings a resume changed)."""
    steps, events = [], []
    with open(os.path.join(out, "log.jsonl"), errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            (events if "event" in rec else steps).append(rec)
    return steps, events


def truncate_log(log_path: str, step: int) -> int:
    """Keep the records of log.jsonl up to `step` (those of a resumed checkpoint); returns how many
    step records were dropped. Rewritten through a temporary file, so a crash never loses it."""
    if not os.path.exists(log_path):
        return 0
    kept, dropped = [], 0
    with open(log_path, errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1                      # a line cut short by a kill
                continue
            if "step" in rec and "event" not in rec and rec["step"] > step:
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = log_path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, log_path)
    return dropped


def run(model: str, data: str, out: str, cfg: TrainConfig, dtype: torch.dtype = torch.float32,
        resume: bool = False, overwrite: bool = False, progress: bool = True, tensor_parallel: int = 1) -> dict:
    """Train `model` ("tiny" or a checkpoint folder) on the text at `data`, writing checkpoints and
    log.jsonl to `out`; under torchrun, data parallel over world / tensor_parallel groups of
    `tensor_parallel` ranks each.

    The window of a step is cfg.global_batch_tokens tokens (or ranks x cfg.accum micro-batches of
    cfg.micro_batch_tokens tokens); it is printed at the start and logged with the layout. Every
    layout trains the same bits, and `resume` continues at another one. Returns a summary (first and
    last step record, checkpoint path, log path). Raises ValueError or OSError on bad input before
    any step, NonFiniteLoss when the loss stops being finite (the last good checkpoint is kept)."""
    from .. import dist as ldist

    distributed = ldist.init_from_env()
    rank = int(os.environ.get("RANK", "0")) if distributed else 0
    try:
        cfg.validate()
        checks.int_at_least("tensor_parallel", tensor_parallel)
        world = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
        if world % tensor_parallel:
            raise ValueError(f"tensor_parallel: {tensor_parallel} does not divide the {world} "
                             f"rank{'s' if world > 1 else ''}; start torchrun with a multiple of it")
        ldist.from_rank0(lambda: prepare_out(out, resume, overwrite), "out")   # every rank stops if it refuses
        network, tokens = make_model_and_tokens(model, data, dtype, cfg.seed)
        sync = None
        if distributed:
            ldist.check_consistent(network, asdict(cfg) | {"model": repr(network.config), "tp": tensor_parallel})
            ldist.initialize_model_parallel(tensor_parallel)
            if tensor_parallel > 1:
                ldist.tensor_parallel(network)
            sync = ldist.ParallelSync(network)
        trainer = Trainer(network, PackedDataset(tokens, cfg.seq_len, cfg.micro_batch_tokens, cfg.seed), cfg, sync)
        if resume:
            trainer.resume(out)
        return _train_loop(out, cfg, trainer, rank, progress, resumed=resume)
    finally:
        if distributed:
            torch.distributed.destroy_process_group()


def shard_note(trainer: Trainer) -> str:
    """What the start message says of the optimizer's sharding ("" when it is not asked for)."""
    if not trainer.cfg.shard_optimizer:
        return ""
    if not trainer.sharded:
        return ("; shard_optimizer: one data-parallel rank, nothing to shard (it holds the whole optimizer "
                "state)")
    return (f"; optimizer state sharded over {trainer.sync.dp_size} data-parallel ranks "
            f"({trainer.optimizer_state_bytes()} bytes on rank {trainer.sync.rank})")


def _train_loop(out: str, cfg: TrainConfig, trainer: Trainer, rank: int, progress: bool, resumed: bool) -> dict:
    """Steps, progress, JSONL log and checkpoints; rank 0 alone writes (every rank holds the same bits)."""
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "log.jsonl")
    layout = trainer.layout
    window = cfg.window_sequences(layout["data_parallel"])
    start = {"event": "resume" if resumed else "start", "step": trainer.step_idx, "ranks": trainer.sync.world,
             "data_parallel": layout["data_parallel"], "tensor_parallel": layout["tensor_parallel"],
             "accum": layout["accum"], "micro_batch_tokens": cfg.micro_batch_tokens,
             "global_batch_tokens": window * cfg.seq_len, "layout": layout}
    if resumed:
        start["changes"] = getattr(trainer, "resumed_changes", {})
    if rank == 0:
        start["dropped_log_records"] = truncate_log(log_path, trainer.step_idx) if resumed else 0
        dp, accum = layout["data_parallel"], layout["accum"]
        tp = f", tensor-parallel size {layout['tensor_parallel']}" if layout["tensor_parallel"] > 1 else ""
        tp += shard_note(trainer)
        print(f"lockstep train: global batch {window} sequences x {cfg.seq_len} tokens = {start['global_batch_tokens']} "
              f"tokens per step ({dp} data-parallel rank{'s' if dp > 1 else ''} x {accum} micro-batch"
              f"{'es' if accum > 1 else ''} of up to {cfg.micro_batch_tokens} tokens{tp})"
              + (f"; resumed at step {trainer.step_idx}" if resumed else "")
              + "".join(f"; {k} {a} -> {b}" for k, (a, b) in start.get("changes", {}).items()), file=sys.stderr)
    started = time.time()
    first = last = None
    seen_tokens = 0
    log = open(log_path, "a") if rank == 0 else None
    try:
        if log:
            log.write(json.dumps(start) + "\n")
            log.flush()
        while trainer.step_idx < cfg.steps:
            rec = trainer.step()
            rec["seconds"] = round(time.time() - started, 3)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            first = first or rec
            last = rec
            seen_tokens += rec["tokens"]
            rate = seen_tokens / max(1e-9, time.time() - started)
            done = rec["step"] / cfg.steps
            bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
            if rank == 0 and progress:
                print(f"\r[{bar}] step {rec['step']}/{cfg.steps} loss {rec['loss']:.4f} "
                      f"grad_norm {rec['grad_norm']:.3f} {rate:.0f} tok/s", end="", file=sys.stderr, flush=True)
            if cfg.save_every and rec["step"] % cfg.save_every == 0:
                trainer.save(out)
    finally:
        if log:
            log.close()
    if rank == 0 and progress and first is not None:
        print(file=sys.stderr)
    trainer.save(out)
    return {"rank": rank, "step": trainer.step_idx, "first": first, "last": last,
            "checkpoint": os.path.join(out, f"step-{trainer.step_idx:06d}"), "log": log_path,
            "seconds": time.time() - started}
