"""Model configuration: one dataclass; the family differences are fields, not subclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import checks
from ..numerics.exact_math import power
from ..rotary import LinearRopeScaling, RopeScaling, rope_scaling_from_hf, rope_scaling_to_hf

# Hugging Face model_type -> the fields that make the family what it is.
FAMILIES: dict[str, dict] = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
    "qwen3_moe": dict(qkv_bias=False, qk_norm=True),
    "gemma3_text": dict(qkv_bias=False, qk_norm=True, norm_offset=1.0, hidden_act="gelu_tanh", sandwich_norms=True,
                        embed_scale=True),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
HIDDEN_ACTS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}       # lockstep name -> transformers name
HF_ACTS = {v: k for k, v in HIDDEN_ACTS.items()} | {"gelu_tanh": "gelu_tanh"}   # transformers name -> lockstep's
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    """A decoder-only transformer. Defaults describe a tiny Llama-style model."""

    family: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_style: str = "neox"
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # The MLP's activation: "silu" (SwiGLU, ops.silu_mul) or "gelu_tanh" (GeGLU, ops.gelu_mul).
    hidden_act: str = "silu"
    # Gemma 3. Attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); sliding-window
    # layers, as layer_types says (None: every layer full), with their own rope theta and no scaling;
    # the norms after attention and around the MLP; embeddings times sqrt(hidden_size) in the model's
    # dtype; tanh softcapping of the final logits.
    query_pre_attn_scalar: int | float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    sandwich_norms: bool = False
    embed_scale: bool = False
    final_logit_softcapping: float | None = None
    # Mixture of experts (Qwen3-MoE): layer i is sparse when num_experts > 0, i is not in
    # mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the rest keep the dense MLP. With
    # output_router_logits the trainer adds router_aux_loss_coef x the load-balancing loss.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False       # as in transformers: the trainer adds the auxiliary loss
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family: unknown architecture {self.family!r}; supported: {sorted(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            checks.int_at_least(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, got {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even number (rotary embedding), got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: expected a positive number, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 1:
            raise ValueError(f"rope_theta: expected a number > 1, got {self.rope_theta!r}")
        if self.rope_style not in ("neox", "gptj"):
            raise ValueError(f"rope_style: expected 'neox' or 'gptj', got {self.rope_style!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act: expected one of {sorted(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar: expected a positive number or None, got {self.query_pre_attn_scalar!r}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(f"layer_types: expected {self.num_layers} entries from {LAYER_TYPES}, got "
                                 f"{list(self.layer_types)}")
            if "sliding_attention" in self.layer_types and not (isinstance(self.sliding_window, int)
                                                                 and self.sliding_window >= 1):
                raise ValueError(f"sliding_window: expected a positive int for the sliding_attention layers, got "
                                 f"{self.sliding_window!r}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping: expected a positive number or None, got "
                             f"{self.final_logit_softcapping!r}")
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_experts:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{name}: expected a positive int for a mixture of experts, got {value!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok: expected at most num_experts={self.num_experts}, got "
                                 f"{self.num_experts_per_tok}")

    # --- per-layer choices --------------------------------------------------------------------
    def window(self, layer: int) -> int | None:
        """The attention window of a layer: sliding_window for a sliding_attention layer, else None."""
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def rope_of(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of a layer's rotary embedding: sliding layers use rope_local_theta, unscaled."""
        if self.window(layer) is not None and self.rope_local_theta is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def attn_scale(self) -> float | None:
        # exact_math.power: the C library's pow follows the CPU
        return None if self.query_pre_attn_scalar is None else power(self.query_pre_attn_scalar, -0.5)

    @classmethod
    def tiny(cls, family: str = "llama", **overrides) -> "ModelConfig":
        """A small random-weight model of a family, for tests and demos."""
        base = dict(family=family, **FAMILIES[family])
        if family == "qwen3":
            base["head_dim"] = 24          # independent of hidden_size / num_heads
        if family == "qwen2":
            base["tie_word_embeddings"] = True
        if family == "qwen3_moe":       # layer 0 dense, layer 1 eight experts, two per token
            base.update(head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                        norm_topk_prob=True, mlp_only_layers=(0,), router_aux_loss_coef=0.001)
        if family == "gemma3_text":     # layer 0 slides over 8 keys, layer 1 is global with linear rope scaling
            base.update(tie_word_embeddings=True, query_pre_attn_scalar=24, sliding_window=8,
                        layer_types=("sliding_attention", "full_attention"), rope_theta=1_000_000.0,
                        rope_local_theta=10_000.0, rope_scaling=LinearRopeScaling(8.0))
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read a Hugging Face config.json (transformers 4 or 5 layout)."""
        model_type = hf.get("model_type")
        if model_type == "gemma3" and isinstance(hf.get("text_config"), dict):
            raise ValueError("config.json: model_type='gemma3' is Gemma 3's image-text model; lockstep loads the "
                             "text model (Gemma3ForCausalLM, model_type='gemma3_text')")
        if model_type not in FAMILIES:
            raise ValueError(f"config.json: unknown architecture model_type={model_type!r}; supported: {sorted(FAMILIES)}")
        gemma = model_type == "gemma3_text"
        act_key = "hidden_activation" if gemma and "hidden_activation" in hf else "hidden_act"
        act = hf.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
        if act not in HF_ACTS:
            raise ValueError(f"config.json: {act_key}={act!r} is not supported (expected one of {sorted(HIDDEN_ACTS.values())})")
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        local_theta = None
        if gemma:
            # transformers 5 nests the parameters by layer type; older configs give rope_theta,
            # rope_local_base_freq and a rope_scaling for the global layers.
            full = dict(rope.get("full_attention") or {})
            if not full:
                full = {"rope_theta": hf.get("rope_theta", 1_000_000.0), **legacy}
            sliding = dict(rope.get("sliding_attention") or {})
            local_theta = float(sliding.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
            if rope_scaling_from_hf(sliding, "config.json (sliding_attention rope)") is not None:
                raise ValueError("config.json: rope scaling on the sliding_attention layers is not supported")
            rope = full
        else:
            rope = {**legacy, **rope}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = rope_scaling_from_hf(rope)
        if hf.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported yet")
        for key in ("attn_logit_softcapping",):
            if hf.get(key) is not None:
                raise ValueError(f"config.json: {key}={hf[key]!r} is not supported (expected null)")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention=true is not supported (lockstep models are causal)")
        heads = hf["num_attention_heads"]
        family = FAMILIES[model_type]
        qkv_bias = family["qkv_bias"] if model_type == "qwen2" else bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        extra: dict = {}
        if gemma:
            layers = hf["num_hidden_layers"]
            pattern = int(hf.get("sliding_window_pattern", 6))
            layer_types = hf.get("layer_types") or [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
            extra = dict(query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
                         sliding_window=hf.get("sliding_window", 4096), layer_types=tuple(layer_types),
                         rope_local_theta=local_theta, final_logit_softcapping=hf.get("final_logit_softcapping"))
        if model_type == "qwen3_moe":
            extra = dict(num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
                         num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)),
                         moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
                         norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                         decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                         mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                         router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                         output_router_logits=bool(hf.get("output_router_logits", False)))
        return cls(
            family=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            qk_norm=family["qk_norm"],
            norm_offset=family.get("norm_offset", 0.0),
            hidden_act=HF_ACTS[act],
            sandwich_norms=family.get("sandwich_norms", False),
            embed_scale=family.get("embed_scale", False),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            **extra,
        )

    def to_hf(self) -> dict:
        """A config.json that transformers and `load_model` both read."""
        rope: dict = {"rope_theta": self.rope_theta, **rope_scaling_to_hf(self.rope_scaling)}
        out = {
            "architectures": [ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": HIDDEN_ACTS[self.hidden_act],
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": rope if self.rope_scaling is not None else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.family != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.family == "gemma3_text":
            del out["hidden_act"], out["rope_theta"], out["rope_scaling"]
            out.update(hidden_activation=HIDDEN_ACTS[self.hidden_act],
                       rope_parameters={"full_attention": rope,
                                        "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": self.rope_local_theta or self.rope_theta}},
                       query_pre_attn_scalar=self.query_pre_attn_scalar, sliding_window=self.sliding_window,
                       layer_types=list(self.layer_types or ["full_attention"] * self.num_layers),
                       final_logit_softcapping=self.final_logit_softcapping, attn_logit_softcapping=None)
        if self.num_experts:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                       router_aux_loss_coef=self.router_aux_loss_coef, output_router_logits=self.output_router_logits)
        return out
