"""GGUF files (llama.cpp's format): read, dequantize, and map to a Hugging Face checkpoint.

A GGUF file holds a header, typed metadata (architecture, hyper-parameters, tokenizer, chat
template) and tensors, many of them quantized in blocks. This module reads it with its own parser
(no llama.cpp, no `gguf` package at run time) and gives what `load_model` needs: a config.json
dict, tensors under Hugging Face names in float32, and the tokenizer files. `lockstep convert`
writes the same as a folder.

Dequantization follows ggml's reference (ggml-quants.c): each value is computed in float32 by the
same operations, in the same order, as `dequantize_row_*`, so the result equals llama.cpp's and the
`gguf` package's bit for bit (tests/test_gguf.py).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)

# ggml_type ids -> (name, elements per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
         7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
         11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
         15: ("Q8_K", 256, 292), 30: ("BF16", 1, 2)}
TYPE_IDS = {name: i for i, (name, _, _) in TYPES.items()}

# GGUF metadata value types: id -> struct format (None: string, array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]        # torch order (GGUF lists dims innermost first)
    ggml_type: int
    offset: int                   # from the start of the data section

    @property
    def type_name(self) -> str:
        return TYPES.get(self.ggml_type, (f"type {self.ggml_type}",))[0]

    def nbytes(self) -> int:
        _, block, size = TYPES[self.ggml_type]
        return int(np.prod(self.shape, dtype=np.int64)) // block * size


class _Reader:
    """Sequential reads from the file's bytes, with a ValueError naming the file at the end."""

    def __init__(self, path: str, data: memoryview):
        self.path, self.data, self.pos = path, data, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError(f"{self.path}: truncated GGUF file: the header needs byte {self.pos + n:,} "
                             f"but the file has {len(self.data):,}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.scalar("<Q")))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: a GGUF string at byte {self.pos - len(raw)} is not UTF-8; "
                             "the file is damaged") from None

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:                 # numeric arrays in one read
                dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {vtype} at byte {self.pos}; "
                         "the file is damaged or from a newer GGUF version")


class GGUFFile:
    """A GGUF file: `metadata` (key -> value), `tensors` (name -> TensorInfo), and the data.

    Raises ValueError naming the file for a wrong magic number, an unsupported version, a
    truncated file or an unknown tensor type."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"path: no GGUF file at {path!r}")
        self._array = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
        r = _Reader(path, memoryview(self._array))
        if len(self._array) < 4 or bytes(r.take(4)) != MAGIC:
            raise ValueError(f"{path}: not a GGUF file (expected the magic number b'GGUF', "
                             f"got {bytes(self._array[:4])!r})")
        self.version = r.scalar("<I")
        if self.version not in VERSIONS:
            raise ValueError(f"{path}: GGUF version {self.version} is not supported (expected one of {VERSIONS})")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = r.string()
            self.metadata[key] = r.value(r.scalar("<I"))
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
            ggml_type, offset = r.scalar("<I"), r.scalar("<Q")
            if ggml_type not in TYPES:
                raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}; "
                                 f"known: {sorted(TYPE_IDS)}")
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, offset)
        alignment = int(self.metadata.get("general.alignment", 32))
        self.data_start = -(-r.pos // alignment) * alignment
        for t in self.tensors.values():
            end = self.data_start + t.offset + t.nbytes()
            if end > len(self._array):
                raise ValueError(f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte {end:,} but the "
                                 f"file has {len(self._array):,}")

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` (uint8)."""
        t = self.tensors[name]
        start = self.data_start + t.offset
        return self._array[start:start + t.nbytes()]

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor `name`, dequantized to float32 and then cast to `dtype`, in torch's dim order."""
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        t = self.tensors[name]
        return dequantize(self.raw(name), t.ggml_type, t.shape, self.path, name).to(dtype)


SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian fp16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit packing: a block's first half in the low nibbles, its second half in the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K super-block (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    low = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([low[0] & 63, (low[2] & 0x0F) | ((low[0] >> 6) << 4)], axis=1)
    mn = np.concatenate([low[1] & 63, (low[2] >> 4) | ((low[1] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _dequantize_blocks(blocks: np.ndarray, name: str) -> np.ndarray:
    """[n_blocks, bytes] -> [n_blocks, elements] float32, as ggml's dequantize_row_<name>."""
    f32 = np.float32
    if name == "Q8_0":
        return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(f32)
    if name == "Q4_0":
        return (_nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)).astype(f32) * _f16(blocks, 0)
    if name == "Q4_1":
        return _nibbles(blocks[:, 4:]).astype(f32) * _f16(blocks, 0) + _f16(blocks, 2)
    if name == "Q4_K":
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _q4_k_scales(blocks[:, 4:16])
        scale, shift = d * sc, dmin * mn                                   # [n, 8]: one per 32 values
        qs = blocks[:, 16:].reshape(-1, 4, 32)                             # 4 chunks of 64 values
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(f32)
        return (scale[:, :, None] * q - shift[:, :, None]).reshape(-1, 256)
    if name == "Q6_K":
        ql, qh = blocks[:, :128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
        sc = blocks[:, 192:208].view(np.int8).astype(f32)                  # one per 16 values
        d = _f16(blocks, 208)
        # Each half of 128 values: 4 groups of 32, low 4 bits from ql, high 2 bits from qh.
        low = np.concatenate([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4],
                             axis=2)
        high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2)
        q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(f32).reshape(-1, 16, 16)
        return ((d * sc)[:, :, None] * q).reshape(-1, 256)
    raise AssertionError(name)


def dequantize(raw: np.ndarray | bytes, ggml_type: int, shape: tuple[int, ...], path: str = "<bytes>",
               name: str = "<tensor>") -> torch.Tensor:
    """The float32 tensor of `shape` (torch order) stored as `raw` bytes in ggml type `ggml_type`."""
    raw = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray)) else np.asarray(raw)
    type_name, block, size = TYPES.get(ggml_type, (f"type {ggml_type}", 1, 1))
    if type_name not in SUPPORTED:
        raise ValueError(f"{path}: tensor {name!r} is quantized as {type_name}, which lockstep cannot read; "
                         f"supported: {', '.join(SUPPORTED)}")
    count = int(np.prod(shape, dtype=np.int64))
    if count % block or raw.size != count // block * size:
        raise ValueError(f"{path}: tensor {name!r} ({type_name}, shape {list(shape)}) needs "
                         f"{count // block * size} bytes, got {raw.size}")
    if type_name == "F32":
        out = raw.view("<f4").astype(np.float32)
    elif type_name == "F16":
        out = raw.view("<f2").astype(np.float32)
    elif type_name == "BF16":
        out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        out = _dequantize_blocks(raw.reshape(-1, size), type_name)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(shape))


# ---------------------------------------------------------------------------------------------
# GGUF -> Hugging Face: config, tensor names, tokenizer
# ---------------------------------------------------------------------------------------------

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}     # GGUF name -> HF model_type

_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _architecture(g: GGUFFile) -> str:
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{g.path}: architecture {arch!r} is not supported; lockstep reads GGUF files of "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return arch


def hf_config(g: GGUFFile) -> dict:
    """A Hugging Face config.json for the model in `g`."""
    arch = _architecture(g)
    m = g.metadata

    def key(name: str, default=None):
        value = m.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{g.path}: metadata {arch}.{name} is missing")
        return value

    if "rope_freqs.weight" in g.tensors:
        # llama.cpp bakes Llama 3.1's rope scaling into per-frequency factors, and the parameters
        # that made them are not stored: guessing would rotate every position slightly wrong.
        raise ValueError(f"{g.path}: rope_freqs.weight (Llama 3.1-style rope scaling factors) is not supported")
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{g.path}: {arch}.rope.dimension_count={key('rope.dimension_count')} rotates part of "
                         f"each head (head_dim {head_dim}); lockstep rotates whole heads")
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{g.path}: {arch}.rope.scaling.type={scaling!r} is not supported (expected 'none' or "
                         "'linear')")
    vocab = len(m["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in m else int(key("vocab_size"))
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    for field, meta in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                        ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if meta in m:
            config[field] = int(m[meta])
    return config


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"tensor {gguf_name!r} has no Hugging Face counterpart that lockstep knows")


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a Llama q or k projection's rows ([n_heads * head_dim, ...]).

    llama.cpp rotates interleaved pairs (GPT-J style) and its converter reorders each head's rows
    from Hugging Face's two halves to pairs; this puts them back."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's reordering (the inverse of `unpermute_rope`), for tests and round trips."""
    out = w.shape[0]
    return w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_tensors(g: GGUFFile, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of `g` under its Hugging Face name, dequantized, in `dtype`."""
    config = hf_config(g)
    arch = _architecture(g)
    out = {}
    for name in g.tensors:
        t = g.tensor(name, torch.float32)
        if arch == "llama" and name.split(".")[-2:-1] in (["attn_q"], ["attn_k"]):
            heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
            t = unpermute_rope(t, heads)
        out[hf_name(name)] = t.to(dtype)
    return out


# How llama.cpp splits text before byte-level BPE, by tokenizer.ggml.pre, where it is not GPT-2's
# regex (which the ByteLevel pre-tokenizer applies by itself).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
PRE_DIGITS = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")   # one digit a piece
PRE_GPT2 = ("gpt-2", "gpt2", "default", None)


def _pre_tokenizer(g: GGUFFile, pre: str | None) -> dict:
    """The tokenizer.json pre_tokenizer for llama.cpp's `tokenizer.ggml.pre`; an unknown one warns
    and splits with GPT-2's regex."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in PRE_SPLITS:
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_SPLITS[pre]}, "behavior": "Isolated", "invert": False},
            {**byte_level, "use_regex": False}]}
    if pre in PRE_DIGITS:
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    if pre not in PRE_GPT2:
        import warnings

        warnings.warn(f"{g.path}: tokenizer.ggml.pre={pre!r} is not one lockstep knows; splitting text with GPT-2's "
                      "regex, which may tokenize some text differently from llama.cpp", stacklevel=3)
    return byte_level


def tokenizer_files(g: GGUFFile) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json (with the chat template) for the model in `g`."""
    m = g.metadata
    model = m.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{g.path}: tokenizer model {model!r} is not supported; lockstep reads byte-level BPE "
                         "('gpt2') tokenizers from GGUF files")
    tokens: list[str] = m["tokenizer.ggml.tokens"]
    types: list[int] = m.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(x.split(" ", 1)) for x in m.get("tokenizer.ggml.merges", [])]
    special = [i for i, t in enumerate(types) if t in (3, 4)]        # control and user-defined tokens
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": types[i] == 3} for i in special],
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(g, m.get("tokenizer.ggml.pre")),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [list(p) for p in merges]},
    }

    def token(meta: str) -> str | None:
        i = m.get(meta)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": int(m.get(f"{g.architecture}.context_length", 2048)),
              "add_bos_token": bool(m.get("tokenizer.ggml.add_bos_token", False))}
    for field, meta in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                        ("unk_token", "tokenizer.ggml.unknown_token_id"),
                        ("pad_token", "tokenizer.ggml.padding_token_id")):
        if token(meta) is not None:
            config[field] = token(meta)
    if "tokenizer.chat_template" in m:
        config["chat_template"] = m["tokenizer.chat_template"]
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
            "tokenizer_config.json": json.dumps(config, indent=1, ensure_ascii=False)}


def find_gguf(path: str) -> str | None:
    """`path` if it is a .gguf file; the one .gguf file in folder `path` (without a config.json);
    else None. Several .gguf files in one folder are an error that lists them."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") or _has_magic(path) else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"path: {path} holds several GGUF files {found}; name one")
    return os.path.join(path, found[0]) if found else None


def _has_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC
