"""lockstep.train.checkpoint: a training run's state on disk.

A checkpoint holds safetensors weights, the optimizer state, the RNG state, the step and the data
position, whole (never a rank's shard), so a run resumes at another layout. It is written to a
temporary folder and renamed into place, so a crash never leaves a checkpoint that loads
half-written. Resuming continues bitwise like an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from ..dist.collectives import from_rank0
from ..model import ModelConfig
from ..model.files import read_json, read_tensors, safetensors_files

if TYPE_CHECKING:
    from .trainer import Trainer

# What a resumed run may change (logged); every other setting defines the run and must match. The
# micro-batch size, the accumulation steps and the global batch setting may change as long as the
# window (sequences per step) stays: they are the layout, like the data- and tensor-parallel sizes.
LAYOUT_SETTINGS = ("micro_batch_tokens", "accum", "global_batch_tokens")
RESUMABLE = ("steps", "save_every", "log_every", "keep_checkpoints") + LAYOUT_SETTINGS


def model_fingerprint(config: ModelConfig) -> str:
    d = asdict(config)
    d.pop("extra", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def latest_checkpoint(out_dir: str) -> str:
    """The folder out_dir/latest points at; errors name what is missing or damaged."""
    latest = os.path.join(out_dir, "latest")
    if not os.path.exists(latest):
        raise FileNotFoundError(f"resume: no checkpoint in {out_dir} (no 'latest' file)")
    with open(latest, errors="replace") as f:
        name = f.read().strip()
    path = os.path.join(out_dir, name)
    if not re.fullmatch(r"step-\d{6}", name) or not os.path.isdir(path):
        raise ValueError(f"resume: {latest} names {name!r}, which is not a checkpoint folder in {out_dir}")
    return path


def save(trainer: "Trainer", out_dir: str, extra: dict | None = None) -> str:
    """Write out_dir/step-NNNNNN atomically and point out_dir/latest at it. Every rank calls
    it; rank 0 writes (every data-parallel rank holds the same bits, and shards are gathered).
    `extra` (JSON) is the caller's own state, such as an RL loop's; `resume` puts it back in
    `trainer.resumed_extra`."""
    params, state_tensors = trainer.full_state()
    name = f"step-{trainer.step_idx:06d}"
    final = os.path.join(out_dir, name)

    def write() -> None:
        try:
            _write(trainer, out_dir, name, params, state_tensors, extra)
        except Exception as e:              # safetensors reports a full disk as its own error type
            raise OSError(f"checkpoint {final}: not written ({type(e).__name__}: {e}); the previous checkpoint "
                          f"in {out_dir}, if any, is kept") from e
        prune(out_dir, trainer.cfg.keep_checkpoints)

    if trainer.sync.world == 1:
        write()
    else:       # rank 0 writes and its error reaches every rank, so none waits for it at a later collective
        from_rank0(write, "checkpoint")
    return final


def _write(trainer: "Trainer", out_dir: str, name: str, params: dict, state_tensors: dict, extra: dict | None) -> None:
    """Write the checkpoint into a temporary folder, rename it to out_dir/name, then point
    out_dir/latest at it; a failure at any point removes the temporary folder."""
    from safetensors.torch import save_file

    final = os.path.join(out_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        trainer.model.save(tmp, tensors=params)
        save_file({k: v.contiguous() for k, v in state_tensors.items()}, os.path.join(tmp, "optimizer.safetensors"))
        settings = trainer.settings()
        data = trainer.data.state() if trainer.data is not None else None
        state = {"step": trainer.step_idx, "data": data, "rng": trainer.rng.get_state().tolist(),
                 "model_fingerprint": model_fingerprint(trainer.model.config), "train_config": settings["train_config"],
                 "dtype": settings["dtype"], "data_fingerprint": settings["data"], "window": settings["window"],
                 "layout": settings["layout"], "extra": extra or {}}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f)
        for f_name in os.listdir(tmp):
            with open(os.path.join(tmp, f_name), "rb") as f:
                os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = os.path.join(out_dir, ".latest.tmp")
        with open(latest_tmp, "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(out_dir, "latest"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prune(out_dir: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` step-NNNNNN folders of out_dir (0: keep every one); the
    folder `latest` names is always kept. Returns the deleted folders."""
    if keep == 0:
        return []
    current = os.path.basename(latest_checkpoint(out_dir))
    steps = sorted(n for n in os.listdir(out_dir) if re.fullmatch(r"step-\d{6}", n) and n != current)
    doomed = steps[:max(0, len(steps) - (keep - 1))]
    for n in doomed:
        shutil.rmtree(os.path.join(out_dir, n))
    return [os.path.join(out_dir, n) for n in doomed]


def resume(trainer: "Trainer", out_dir: str) -> int:
    """Load out_dir/latest, at this trainer's layout whatever the checkpoint's; returns the step.
    Refuses a checkpoint of another model, and a change of any setting that defines the run
    (`changes_from` says which); the allowed changes, the layout's included, are kept in
    `trainer.resumed_changes`."""
    path = latest_checkpoint(out_dir)
    state = read_json(os.path.join(path, "trainer_state.json"), "trainer_state.json")
    if state.get("model_fingerprint") != model_fingerprint(trainer.model.config):
        raise ValueError(f"resume: checkpoint {path} belongs to another model (config fingerprint "
                         f"{state.get('model_fingerprint')}, this model {model_fingerprint(trainer.model.config)})")
    trainer.resumed_changes = changes_from(trainer, state, path)
    weights = {}
    for f in safetensors_files(path):
        weights.update(read_tensors(f))
    optimizer = read_tensors(os.path.join(path, "optimizer.safetensors"))
    try:
        with torch.no_grad():
            for n, p in trainer.named:
                p.copy_(trainer.sync.shard_tensor(n, weights[n]))
        shards = {k: trainer.sync.shard_tensor(k.split(".", 1)[1], v) for k, v in optimizer.items()}
        trainer.opt.load_state_tensors(shards, state["step"])
        if trainer.data is not None:
            trainer.data.load_state(state["data"])
        trainer.rng.set_state(torch.tensor(state["rng"], dtype=torch.uint8))
    except (KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"resume: checkpoint {path} is incomplete or damaged ({type(e).__name__}: {e})") from None
    trainer.step_idx = state["step"]
    trainer.resumed_extra = state.get("extra", {})
    return trainer.step_idx


def changes_from(trainer: "Trainer", state: dict, path: str = "the checkpoint") -> dict:
    """The settings that differ between a checkpoint's `state` and this trainer, as
    {name: [old, new]}, the layout's included. Raises ValueError, naming the setting and both
    values, when one that defines the run differs (RESUMABLE lists the settings that may)."""
    now = trainer.settings()
    old_cfg = state.get("train_config", {})
    changes, refused = {}, []
    for name, new in now["train_config"].items():
        if name not in old_cfg:
            continue
        old = old_cfg[name]
        if isinstance(new, (list, tuple)):            # JSON gives lists where the config has tuples
            old, new = list(old), list(new)
        if old == new:
            continue
        if name in RESUMABLE:
            changes[name] = [old, new]
        else:
            refused.append((name, old, new))
    for name, key in (("dtype", "dtype"), ("data", "data_fingerprint"), ("window", "window")):
        if key in state and state[key] != now[name]:
            refused.append((name, state[key], now[name]))
    if state.get("layout") is not None and state["layout"] != now["layout"]:
        changes["layout"] = [state["layout"], now["layout"]]
    if any(n == "window" for n, _, _ in refused):
        why = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items() if k in LAYOUT_SETTINGS)
        refused = [(f"window (sequences per step; {why or 'the data-parallel size'} changed it, and the "
                    f"layout may change only with the window kept: ranks x accum x micro_batch_tokens, or "
                    f"global_batch_tokens)" if n == "window" else n, o, v) for n, o, v in refused]
    if refused:
        what = "; ".join(f"{n}: {o!r} in the checkpoint, {v!r} now" for n, o, v in refused)
        raise ValueError(f"resume: {path} was written with other settings ({what}). A resumed run keeps the "
                         f"settings that define it; start a new run in another --out to change them")
    return changes
