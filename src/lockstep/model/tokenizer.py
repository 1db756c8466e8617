"""Tokenizers: Hugging Face `tokenizers` from a local tokenizer.json, or the built-in byte tokenizer.

A tokenizer read from a folder remembers it, and `save(path)` copies its files into a checkpoint,
so that a checkpoint carries the tokenizer of the model it came from.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import TYPE_CHECKING

from .config import ModelConfig

if TYPE_CHECKING:
    from .transformer import Transformer

# The files of a Hugging Face tokenizer that a checkpoint folder may hold.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
# Written into checkpoints of models that use the built-in byte tokenizer (`lockstep train --model tiny`).
BYTES_MARKER = "lockstep_byte_tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 is BOS and 257 is EOS. Needs a vocabulary of at least 258.

    fallback_for: the folder whose missing tokenizer this one stands in for; encoding a string then
    warns once, since the model was almost certainly trained with another tokenizer."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def __init__(self, fallback_for: str | None = None):
        self.fallback_for = fallback_for
        self._warned = False

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if self.fallback_for is not None and not self._warned:
            self._warned = True
            warnings.warn(f"{self.fallback_for} has no tokenizer.json: text is encoded as UTF-8 bytes (ids 0-255), "
                          "not with the model's own tokenizer; pass token ids, or add the tokenizer files",
                          stacklevel=2)
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, path: str) -> None:
        """Mark `path` as a byte-tokenizer checkpoint (BYTES_MARKER), unless this tokenizer only stands
        in for a missing one."""
        if self.fallback_for is None:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, BYTES_MARKER), "w") as f:
                json.dump({"tokenizer": "lockstep bytes", "bos_token_id": self.bos_token_id,
                           "eos_token_id": self.eos_token_id}, f)


class HFTokenizer:
    """A tokenizer.json read with the `tokenizers` library (no network, no transformers), from a
    folder or from the files' contents (a GGUF file carries them; `files`).

    `config` is the tokenizer_config.json beside it ({} without one): its chat template and special
    tokens."""

    def __init__(self, path: str | None, config: ModelConfig | None = None, files: dict[str, str] | None = None):
        from tokenizers import Tokenizer

        if files is not None:
            self.folder, self.files = None, dict(files)
            self._tok = Tokenizer.from_str(files["tokenizer.json"])
            self.config = json.loads(files.get("tokenizer_config.json", "{}"))
        else:
            self.folder, self.files = os.path.dirname(os.path.abspath(path)), None
            self._tok = Tokenizer.from_file(path)
            config_path = os.path.join(self.folder, "tokenizer_config.json")
            self.config = {}
            if os.path.isfile(config_path):
                with open(config_path) as f:
                    self.config = json.load(f)
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_token_id = config.bos_token_id if config else None
        eos = config.eos_token_id if config else None
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def save(self, path: str) -> None:
        """Write this tokenizer's files into `path`: those it was read from (TOKENIZER_FILES in its
        folder), or the contents it was given."""
        if self.folder is not None and os.path.abspath(path) == self.folder:
            return
        os.makedirs(path, exist_ok=True)
        if self.files is not None:
            for name, content in self.files.items():
                with open(os.path.join(path, name), "w") as f:
                    f.write(content)
            return
        for name in TOKENIZER_FILES:
            src = os.path.join(self.folder, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))


def load_tokenizer(path: str | None, config: ModelConfig | None = None):
    """HFTokenizer when `path` holds tokenizer.json; else the byte tokenizer (which warns on its first
    string when it stands in for the missing tokenizer of a folder)."""
    if path and os.path.exists(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(os.path.join(path, "tokenizer.json"), config)
    if path and os.path.exists(os.path.join(path, BYTES_MARKER)):
        return ByteTokenizer()
    return ByteTokenizer(fallback_for=path)


def with_byte_tokenizer(model: Transformer) -> Transformer:
    """`model`, given the built-in byte tokenizer if it has none (the tiny model, built rather than
    read from a folder, reads and writes UTF-8 bytes); a model with a tokenizer keeps its own."""
    if model.tokenizer is None:
        model.tokenizer = ByteTokenizer()
    return model
