"""Tiny random-weight models of each family, built and saved by transformers (the real peer)."""

import functools

import torch

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def hf_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if family == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=24)
    raise ValueError(family)


@functools.cache
def saved_hf_model(family: str, root: str) -> str:
    """Save a random transformers model of `family` under root/family and return the folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3}[family])
    model = AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = f"{root}/{family}"
    model.save_pretrained(path)
    return path
