"""The realistic benchmark model: Qwen3-0.6B's shape (hidden 1024, 16 query / 8 KV heads, head_dim
128, intermediate 3072, vocabulary 151,936, tied embeddings), with fewer layers on CPU and random
weights; and the same model in transformers."""

import time

import torch

from lockstep.model import ModelConfig, Transformer

LAYERS = 4
SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128,
             tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1_000_000.0)


def lockstep_model(dtype=torch.bfloat16, layers: int = LAYERS) -> Transformer:
    return Transformer.from_config(ModelConfig.tiny("qwen3", num_layers=layers, **SHAPE), seed=0, dtype=dtype).eval()


def hf_model(ours: Transformer, attn: str = "sdpa"):
    """transformers' Qwen3 with the same weights."""
    import transformers

    hf_config = transformers.Qwen3Config(**{k: v for k, v in ours.config.to_hf().items()
                                            if k not in ("architectures", "model_type")})
    model = transformers.Qwen3ForCausalLM(hf_config)
    model.load_state_dict({n: p.detach().clone() for n, p in ours.named_parameters()}, strict=False)
    model.tie_weights()
    model.config._attn_implementation = attn
    return model.to(ours.dtype).eval()


def best_of(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` timed runs after one warm-up run, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
