"""Benchmark: one Qwen3-MoE layer and one Gemma 3 layer, lockstep against transformers eager, same run.

Each model is one decoder layer (embedding, attention, the MLP, the final norm; no LM head) at a real
model's per-layer shape, with random weights shared by both sides:
- Qwen3-MoE: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, experts of width
  768, 8 per token) with 16 experts instead of 128, so that the weights fit a small machine; the
  work per token is the real one.
- Gemma 3: Gemma-3-1B's layer (hidden 1152, 4 query / 1 KV head of 256, GeGLU width 6912, a
  sliding window of 512).
transformers runs attention "eager" and its experts both ways ("eager" loops, and its default
"grouped_mm"). Forward is timed without gradients; forward + backward with them. Ratios are
lockstep / transformers. Usage: python benchmarks/bench_models.py [--quick]
"""

import platform
import sys

import torch

from _realistic import best_of
from lockstep.model import ModelConfig, Transformer

MOE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_layers=1, num_heads=32, num_kv_heads=4,
           head_dim=128, num_experts=16, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
           mlp_only_layers=(), rope_theta=1_000_000.0)
GEMMA = dict(vocab_size=32000, hidden_size=1152, intermediate_size=6912, num_layers=1, num_heads=4, num_kv_heads=1,
             head_dim=256, query_pre_attn_scalar=256, sliding_window=512, layer_types=("sliding_attention",))


def models(family: str, shape: dict, dtype: torch.dtype):
    """(lockstep Transformer, transformers base model) with the same random weights."""
    import transformers

    ours = Transformer.from_config(ModelConfig.tiny(family, **shape), seed=0, dtype=dtype).eval()
    hf_cfg = transformers.AutoConfig.for_model(family, **{k: v for k, v in ours.config.to_hf().items()
                                                          if k not in ("architectures", "model_type")})
    full = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").to(dtype).eval()
    state = {n: p.detach().clone() for n, p in ours.named_parameters()}
    for layer in range(ours.config.num_layers if ours.config.num_experts else 0):
        prefix = f"model.layers.{layer}.mlp.experts."
        e = range(ours.config.num_experts)
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{prefix}{i}.gate_proj.weight"),
                                                                  state.pop(f"{prefix}{i}.up_proj.weight")]) for i in e])
        state[prefix + "down_proj"] = torch.stack([state.pop(f"{prefix}{i}.down_proj.weight") for i in e])
    missing, unexpected = full.load_state_dict(state, strict=False)
    assert not unexpected and all(m.endswith("lm_head.weight") for m in missing), (missing, unexpected)
    return ours, full.model


def rows(family: str, shape: dict, dtype: torch.dtype, tokens: int, repeats: int) -> list[tuple]:
    ours, hf = models(family, shape, dtype)
    ids = torch.randint(0, shape["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, tokens])

    def ours_fwd():
        with torch.no_grad():
            ours(ids, cu)

    def ours_fwd_bwd():
        ours.zero_grad(set_to_none=True)
        ours(ids, cu).float().square().mean().backward()

    def hf_fwd():
        with torch.no_grad():
            hf(ids[None]).last_hidden_state

    def hf_fwd_bwd():
        hf.zero_grad(set_to_none=True)
        hf(ids[None]).last_hidden_state.float().square().mean().backward()

    out = []
    impls = ["eager", "grouped_mm"] if family == "qwen3_moe" else ["eager"]
    t_ours = best_of(ours_fwd, repeats), best_of(ours_fwd_bwd, repeats)
    for impl in impls:
        if family == "qwen3_moe":
            hf.set_experts_implementation(impl)
        t_hf = best_of(hf_fwd, repeats), best_of(hf_fwd_bwd, repeats)
        for work, a, b in (("forward", t_ours[0], t_hf[0]), ("forward + backward", t_ours[1], t_hf[1])):
            out.append((family, str(dtype).removeprefix("torch."), tokens, work, impl, a, b))
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    torch.manual_seed(0)
    tokens = 128 if quick else 512
    repeats = 1 if quick else 3
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("| layer | dtype | tokens | work | transformers experts | lockstep ms | transformers eager ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for family, shape in (("qwen3_moe", MOE), ("gemma3_text", GEMMA)):
            for fam, dt, n, work, impl, a, b in rows(family, shape, dtype, tokens, repeats):
                label = "Qwen3-MoE (30B-A3B shape, 16 experts)" if fam == "qwen3_moe" else "Gemma 3 (1B shape)"
                print(f"| {label} | {dt} | {n} | {work} | {impl if fam == 'qwen3_moe' else '-'} | {a * 1e3:.1f} | "
                      f"{b * 1e3:.1f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
