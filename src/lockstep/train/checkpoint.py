"""lockstep.train.checkpoint: a training run's state on disk.

A checkpoint holds safetensors weights, the optimizer state, the RNG state, the step and the data
position, whole (never a rank's shard), so a run resumes at another layout. It is written to a
temporary folder and renamed into place, so a crash never leaves a checkpoint that loads
half-written. Resuming continues bitwise like an uninterrupted run.

The module reads and writes a `TrainerState`, the data alone: the Trainer builds one to save and
puts the one it loads in place itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
import torch
from torch import Tensor

from ..dist.collectives import from_rank0
from ..model import ModelConfig, Transformer
from ..model.files import read_json, read_tensors, safetensors_files


@dataclass
class TrainerState:
    """A run's state as a checkpoint holds it, whole (no rank's shard).

    params: {name: tensor} of the model; optimizer: the optimizer's state tensors ("kind.name"); rng:
    the trainer's torch.Generator state (uint8); data: the dataset's position (None when windows are
    given); settings: what defines the run (Trainer.settings: train_config, dtype, data, window,
    layout); extra: the caller's own JSON state, such as an RL loop's."""
    step: int
    params: dict[str, Tensor]
    optimizer: dict[str, Tensor]
    rng: Tensor
    data: dict | None
    settings: dict
    extra: dict = field(default_factory=dict)


# What a resumed run may change (logged); every other setting defines the run and must match. The
# micro-batch size, the accumulation steps and the global batch setting may change as long as the
# window (sequences per step) stays: they are the layout, like the data- and tensor-parallel sizes.
LAYOUT_SETTINGS = ("micro_batch_tokens", "accum", "global_batch_tokens")
# Sharding the optimizer is layout too, but leaves the window as it is.
RESUMABLE = ("steps", "save_every", "log_every", "keep_checkpoints", "shard_optimizer") + LAYOUT_SETTINGS
# Trainer.settings' names -> trainer_state.json's.
_SETTINGS_KEYS = {"train_config": "train_config", "dtype": "dtype", "data": "data_fingerprint", "window": "window",
                  "layout": "layout"}


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


def save(state: TrainerState, model: Transformer, out_dir: str, keep: int, world: int = 1) -> str:
    """Write `state` (and `model`'s config) to out_dir/step-NNNNNN atomically, point out_dir/latest at
    it and keep the newest `keep` checkpoints (`prune`). Every one of the `world` ranks calls it;
    rank 0 writes (every data-parallel rank holds the same bits, and shards are gathered)."""
    name = f"step-{state.step:06d}"
    final = os.path.join(out_dir, name)

    def write() -> None:
        try:
            _write(state, model, out_dir, name)
        except Exception as e:              # safetensors reports a full disk as its own error type
            raise OSError(f"checkpoint {final}: not written ({type(e).__name__}: {e}); the previous checkpoint "
                          f"in {out_dir}, if any, is kept") from e
        prune(out_dir, keep)

    if world == 1:
        write()
    else:       # rank 0 writes and its error reaches every rank, so none waits for it at a later collective
        from_rank0(write, "checkpoint")
    return final


def _write(state: TrainerState, model: Transformer, out_dir: str, name: str) -> None:
    """Write the checkpoint into a temporary folder, rename it to out_dir/name, then point
    out_dir/latest at it; a failure at any point removes the temporary folder."""
    from safetensors.torch import save_file

    final = os.path.join(out_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save(tmp, tensors=state.params)
        save_file({k: v.contiguous() for k, v in state.optimizer.items()}, os.path.join(tmp, "optimizer.safetensors"))
        record = {"step": state.step, "data": state.data, "rng": state.rng.tolist(),
                  "model_fingerprint": model_fingerprint(model.config),
                  **{key: state.settings[name] for name, key in _SETTINGS_KEYS.items()}, "extra": state.extra or {}}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(record, f)
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


def load(path: str, config: ModelConfig, settings: dict) -> tuple[TrainerState, dict]:
    """The checkpoint in folder `path` (`latest_checkpoint` finds a run's newest) as a TrainerState,
    with the allowed changes of setting ({name: [old, new]}, the layout's included). Refuses a
    checkpoint of another model than `config`, and a change of any setting that defines the run
    (`changes_from` compares the checkpoint with `settings`, a trainer's)."""
    record = read_json(os.path.join(path, "trainer_state.json"), "trainer_state.json")
    if record.get("model_fingerprint") != model_fingerprint(config):
        raise ValueError(f"resume: checkpoint {path} belongs to another model (config fingerprint "
                         f"{record.get('model_fingerprint')}, this model {model_fingerprint(config)})")
    changes = changes_from(settings, record, path)
    weights = {}
    for f in safetensors_files(path):
        weights.update(read_tensors(f))
    optimizer = read_tensors(os.path.join(path, "optimizer.safetensors"))
    try:
        state = TrainerState(record["step"], weights, optimizer, torch.tensor(record["rng"], dtype=torch.uint8),
                             record.get("data"), {k: record.get(v) for k, v in _SETTINGS_KEYS.items()},
                             record.get("extra", {}))
    except (KeyError, TypeError, RuntimeError) as e:
        raise damaged(path, e) from None
    return state, changes


def damaged(path: str, error: Exception) -> ValueError:
    """The error for checkpoint `path` when reading it or putting its state in place failed with
    `error` (a missing entry, a tensor of another shape): the checkpoint is incomplete or damaged."""
    return ValueError(f"resume: checkpoint {path} is incomplete or damaged ({type(error).__name__}: {error})")


def changes_from(now: dict, state: dict, path: str = "the checkpoint") -> dict:
    """The settings that differ between a checkpoint's `state` (trainer_state.json) and `now` (a
    trainer's settings), as {name: [old, new]}, the layout's included. Raises ValueError, naming the
    setting and both values, when one that defines the run differs (RESUMABLE lists the settings
    that may)."""
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
