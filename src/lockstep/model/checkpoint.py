"""Hugging Face checkpoints from a local folder: config.json + safetensors (single or sharded).

Everything is validated before a model is built (nothing is half-loaded), and .bin files are never
unpickled: a pickle can run code, and a checkpoint is untrusted input.
"""

from __future__ import annotations

import json
import os

import torch

from .config import ModelConfig
from .tokenizer import load_tokenizer
from .transformer import Transformer

# Buffers some checkpoints carry that hold nothing lockstep needs.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _read_json(index, "model.safetensors.index.json").get("weight_map")
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


def load_model(path: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Transformer:
    """Load a Llama, Qwen2 or Qwen3 checkpoint from a local folder.

    path: folder with config.json and model.safetensors (or shards with model.safetensors.index.json),
    and optionally tokenizer.json. Returns a Transformer in `dtype` on `device`, with `.tokenizer` set.
    Raises ValueError naming any missing, unexpected or mis-shaped tensor."""
    from safetensors import safe_open

    if not os.path.isdir(path):
        raise FileNotFoundError(f"path: {path!r} is not a folder")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"path: no config.json in {path}")
    config = ModelConfig.from_hf(_read_json(cfg_path, "config.json"))
    expected = {name: tuple(p.shape) for name, p in Transformer(config).to("meta").named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if config.tie_word_embeddings and name == "lm_head.weight":
                    continue        # tied: the embedding is the head
                tensors[name] = f.get_tensor(name)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    shapes = [f"{n}: expected {list(expected[n])}, got {list(tensors[n].shape)}"
              for n in sorted(set(expected) & set(tensors)) if tuple(tensors[n].shape) != expected[n]]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    if shapes:
        problems.append(f"mis-shaped tensors {shapes}")
    if problems:
        raise ValueError(f"checkpoint {path}: " + "; ".join(problems))
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = tensors[name].to(dtype=dtype, device=device)
    model.tokenizer = load_tokenizer(path, config)
    return model.to(device=device, dtype=dtype)


def save_model(model: Transformer, path: str) -> None:
    """Write config.json and model.safetensors that `load_model` and transformers both read."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
