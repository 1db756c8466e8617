"""Tokenizers: Hugging Face `tokenizers` from a local tokenizer.json, or the built-in byte tokenizer."""

from __future__ import annotations

import os

from .config import ModelConfig


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 is BOS and 257 is EOS. Needs a vocabulary of at least 258."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json read with the `tokenizers` library (no network, no transformers)."""

    def __init__(self, path: str, config: ModelConfig | None = None):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_token_id = config.bos_token_id if config else None
        eos = config.eos_token_id if config else None
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(path: str | None, config: ModelConfig | None = None):
    """HFTokenizer when `path` holds tokenizer.json, else ByteTokenizer."""
    if path and os.path.exists(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(os.path.join(path, "tokenizer.json"), config)
    return ByteTokenizer()
