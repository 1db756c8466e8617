"""Tiny random-weight models of each family, built and saved by transformers (the real peer)."""

import functools

import torch

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def hf_config(family: str):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if family == "llama":
        return LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if family == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=24)
    if family == "qwen3_moe":       # layer 0 dense, layer 1 eight experts with two per token
        return Qwen3MoeConfig(**COMMON, head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                              norm_topk_prob=True, mlp_only_layers=[0])
    if family == "gemma3_text":     # layer 0 slides over 8 keys; layer 1 is global, its rope linearly scaled
        return Gemma3TextConfig(**COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                    "rope_theta": 1_000_000.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    raise ValueError(family)


def eager(family: str) -> dict:
    """from_pretrained / from_config arguments for transformers' plain eager kernels (its grouped_mm
    experts have no float64 kernel)."""
    return dict(attn_implementation="eager", **({"experts_implementation": "eager"} if family == "qwen3_moe" else {}))


@functools.cache
def saved_hf_model(family: str, root: str) -> str:
    """Save a random transformers model of `family` under root/family and return the folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3, "qwen3_moe": 4, "gemma3_text": 5}[family])
    model = AutoModelForCausalLM.from_config(hf_config(family), **eager(family)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm scales near 1; Gemma stores a norm's scale minus one.
            centre = 0.0 if family == "gemma3_text" else 1.0
            p.copy_(centre + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = f"{root}/{family}"
    model.save_pretrained(path)
    return path
