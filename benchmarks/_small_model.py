"""A small Llama-style model shared by the model, engine and trainer benchmarks (random weights)."""

import torch

from lockstep.model import ModelConfig, Transformer

from _realistic import best_of  # noqa: F401  (one timing helper for every benchmark)

CONFIG = dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4, num_kv_heads=2,
              head_dim=64, max_position_embeddings=4096)


def lockstep_model(dtype=torch.float32):
    return Transformer.from_config(ModelConfig.tiny("llama", **CONFIG), seed=0, dtype=dtype).eval()


def hf_model(ours):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = ours.config
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                      intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                                      num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                                      head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                                      max_position_embeddings=c.max_position_embeddings,
                                      attn_implementation="eager"))
    hf.load_state_dict({n: p.detach().clone() for n, p in ours.named_parameters()}, strict=False)
    return hf.to(ours.dtype).eval()
