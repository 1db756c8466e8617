"""Model configuration: one dataclass; the family differences are fields, not subclasses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..rotary import Llama3RopeScaling

# Hugging Face model_type -> the fields that make the family what it is.
FAMILIES: dict[str, dict] = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
    rope_scaling: Llama3RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family: unknown architecture {self.family!r}; supported: {sorted(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
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

    @classmethod
    def tiny(cls, family: str = "llama", **overrides) -> "ModelConfig":
        """A small random-weight model of a family, for tests and demos."""
        base = dict(family=family, **FAMILIES[family])
        if family == "qwen3":
            base["head_dim"] = 24          # independent of hidden_size / num_heads
        if family == "qwen2":
            base["tie_word_embeddings"] = True
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read a Hugging Face config.json (transformers 4 or 5 layout)."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"config.json: unknown architecture model_type={model_type!r}; supported: {sorted(FAMILIES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported (expected 'silu')")
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = Llama3RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                        float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        elif rope_type not in ("default", None):
            raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (expected 'default' or 'llama3')")
        if hf.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported yet")
        heads = hf["num_attention_heads"]
        family = FAMILIES[model_type]
        qkv_bias = family["qkv_bias"] if model_type == "qwen2" else bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
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
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )

    def to_hf(self) -> dict:
        """A config.json that transformers and `load_model` both read."""
        rope: dict = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
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
            "hidden_act": "silu",
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
        return out
