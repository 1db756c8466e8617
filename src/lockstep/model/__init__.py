"""lockstep.model: Llama, Qwen2, Qwen3, Qwen3-MoE and Gemma 3 decoders built only from lockstep.ops."""

from ..paged_cache import CacheStep
from .checkpoint import DEFAULT_MODEL, convert_gguf, load_model, model_from_source, smollm2_path
from .config import ModelConfig
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, with_byte_tokenizer
from .files import params_digest
from .transformer import (KVCache, Transformer, logprobs, pack, packed_logprobs, positions_from_cu_seqlens,
                          token_entropy)

__all__ = ["ModelConfig", "Transformer", "KVCache", "CacheStep", "load_model", "model_from_source", "convert_gguf",
           "smollm2_path", "DEFAULT_MODEL", "logprobs", "pack", "packed_logprobs", "params_digest",
           "positions_from_cu_seqlens", "token_entropy", "ByteTokenizer", "HFTokenizer", "load_tokenizer",
           "with_byte_tokenizer"]
