"""The command line's parser and the argument types its commands share: a bad argument is a
UsageError, which `main` prints as one line that names the argument, with exit status 2."""

from __future__ import annotations

import argparse
import re

import torch

from .. import contract, registry

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")     # the keys of model.config.FAMILIES


class UsageError(Exception):
    """A bad argument: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageErrors."""

    def error(self, message: str):
        # argparse says "argument --backend: backend: unknown ..."; keep one naming of the argument.
        match = re.match(r"argument [^:]+: ([a-z_]+: .*)", message)
        raise UsageError(match.group(1) if match else message)


def dtype_list(text: str) -> list[torch.dtype]:
    """"fp32,bf16" -> [torch.float32, torch.bfloat16]."""
    try:
        return [contract.parse_dtype(name) for name in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def backend_name(text: str) -> str:
    """A backend's name, one of registry.available_backends()."""
    if text not in registry.available_backends():
        raise argparse.ArgumentTypeError(f"backend: unknown backend {text!r}; expected one of "
                                         f"{registry.available_backends()}")
    return text


def train_dtype(text: str) -> torch.dtype:
    """"fp32" or "bf16" -> the trainer's compute dtype."""
    dtype = dtype_list(text)
    if len(dtype) != 1 or dtype[0] not in (torch.float32, torch.bfloat16):
        raise argparse.ArgumentTypeError(f"dtype: expected fp32 or bf16 (bf16 with --master-weights for fp32 "
                                         f"master weights), got {text!r}")
    return dtype[0]


def serve_dtype(text: str) -> torch.dtype:
    """One dtype name -> the server's compute dtype."""
    dtype = dtype_list(text)
    if len(dtype) != 1:
        raise argparse.ArgumentTypeError(f"dtype: expected one dtype, got {text!r}")
    return dtype[0]


def check_name(text: str) -> str:
    """An op of contract.toml -> the name of the harness check that covers it."""
    known = list(contract.load()["ops"])
    if text not in known:
        raise argparse.ArgumentTypeError(f"op: unknown op {text!r}; expected one of {sorted(known)}")
    return contract.op_entry(text)["check"]


def model_arguments(p: argparse.ArgumentParser, default: str | None) -> None:
    """The MODEL positional (required where `default` is None) and --family, for the tiny model."""
    if default is None:
        p.add_argument("model", help="a local Hugging Face checkpoint folder or GGUF file, 'smollm2' "
                                     "(SmolLM2-135M-Instruct, installed), or 'tiny' (a built-in random model)")
    else:
        p.add_argument("model", nargs="?", default=default,
                       help=f"a local checkpoint folder or GGUF file, 'smollm2' (SmolLM2-135M-Instruct, installed) or "
                            f"'tiny' (random weights); default: {default}")
    p.add_argument("--family", default="llama", choices=FAMILIES, help="family of the tiny model")
