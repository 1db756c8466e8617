"""A Hugging Face model folder on disk: config.json and safetensors weights (single or sharded).

Only safetensors are read: .bin files are pickles, a pickle can run code, and a checkpoint is
untrusted input.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch


def read_json(path: str, what: str) -> dict:
    """The JSON object in `path`; a ValueError that names the file when it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e}); the file is damaged or truncated") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} holds a JSON {type(data).__name__}, expected an object")
    return data


def read_tensors(path: str, skip=lambda name: False) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file but those `skip` names; a ValueError that names the file
    when it is not a readable safetensors file (truncated, garbage, or not safetensors at all)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys() if not skip(name)}
    except Exception as e:          # safetensors raises its own SafetensorError, or OSError, or others
        if isinstance(e, FileNotFoundError):
            raise
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a readable safetensors file ({reason}); the file is damaged or "
                         "truncated") from None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"model.safetensors.index.json: expected a 'weight_map' object in {index}")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise FileNotFoundError(f"path: shards named in the index are missing from {path}: {missing}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return [os.path.join(path, f) for f in files]
    if any(f.endswith(".bin") or f.endswith(".pt") for f in os.listdir(path)):
        raise ValueError(f"path: {path} holds only pickled weights (.bin/.pt); lockstep never unpickles "
                         "checkpoints. Convert them to safetensors first.")
    raise FileNotFoundError(f"path: no *.safetensors weights in {path}")


def write_folder(path: str, tensors: dict[str, torch.Tensor], hf_config: dict) -> None:
    """Write `tensors` to path/model.safetensors (through a temporary file, renamed into place) and
    `hf_config` to path/config.json."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {n: t.contiguous().cpu() for n, t in tensors.items()}
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


def params_digest(named: list[tuple[str, torch.Tensor]], extra: str = "") -> str:
    """sha256 (hex) of `extra` and every tensor's name and bits, in name order: equal exactly when
    two models (or two ranks' shards) hold the same bits under the same names."""
    h = hashlib.sha256(extra.encode())
    for name, p in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
