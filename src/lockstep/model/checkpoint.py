"""Hugging Face checkpoints from a local folder: config.json + safetensors (single or sharded).

Everything is validated before a model is built (nothing is half-loaded), and .bin files are never
unpickled: a pickle can run code, and a checkpoint is untrusted input.
"""

from __future__ import annotations

import os

import torch

from .config import ModelConfig
from .files import read_json, read_tensors, safetensors_files
from .tokenizer import load_tokenizer
from .transformer import Transformer

# Buffers some checkpoints carry that hold nothing lockstep needs.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def split_fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Experts saved fused, as transformers 5 holds them in memory (`mlp.experts.gate_up_proj`
    [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]), as the per-expert tensors of the Hub layout
    (`mlp.experts.{e}.gate_proj.weight`, ...) that lockstep's modules carry. Others pass through."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj") and t.dim() == 3 and t.shape[1] % 2 == 0:
            prefix, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith(".mlp.experts.down_proj") and t.dim() == 3:
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def load_model(path: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Transformer:
    """Load a Llama, Qwen2, Qwen3, Qwen3-MoE or Gemma 3 (text) checkpoint from a local folder.

    path: folder with config.json and model.safetensors (or shards with model.safetensors.index.json),
    and optionally tokenizer.json. Returns a Transformer in `dtype` on `device`, with `.tokenizer` set.
    Raises ValueError naming any missing, unexpected or mis-shaped tensor."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"path: {path!r} is not a folder")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"path: no config.json in {path}")
    config = ModelConfig.from_hf(read_json(cfg_path, "config.json"))
    expected = {name: tuple(p.shape) for name, p in Transformer(config).to("meta").named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    def skip(name: str) -> bool:           # buffers lockstep does not need; a tied head is the embedding
        return name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")

    for file in safetensors_files(path):
        tensors.update(read_tensors(file, skip))
    tensors = split_fused_experts(tensors)
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


def model_from_source(source: str, dtype: torch.dtype = torch.float32, family: str = "llama", seed: int = 0,
                      **tiny_overrides) -> Transformer:
    """`source` "tiny": the built-in random model of `family` (ModelConfig.tiny, weights from `seed`,
    `tiny_overrides` applied to its config); anything else: the checkpoint folder `source`."""
    if source == "tiny":
        return Transformer.from_config(ModelConfig.tiny(family, **tiny_overrides), seed=seed, dtype=dtype)
    return load_model(source, dtype=dtype)
