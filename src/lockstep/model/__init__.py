"""lockstep.model: Llama, Qwen2 and Qwen3 decoders built only from lockstep.ops."""

from .checkpoint import load_model, save_model
from .config import ModelConfig
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from .transformer import CacheStep, KVCache, Transformer, logprobs, pack, positions_from_cu_seqlens

__all__ = ["ModelConfig", "Transformer", "KVCache", "CacheStep", "load_model", "save_model", "logprobs", "pack",
           "positions_from_cu_seqlens", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]
