"""The paged KV cache's layout, shared by every reader and writer of it (docs/adr/0003-paged-kv-cache-layout.md).

A layer's cache is [num_blocks, block_size, kv_heads, head_dim]; a sequence's block table lists its
blocks in order, so its token at position p lives in slot table[p // block_size] * block_size +
p % block_size. `build_step` turns "these sequences, these positions" into the inputs of one
`Transformer.forward_cached` call; the engine, the harness and the parity tools all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class CacheStep:
    """Where the new tokens of one `forward_cached` call go and what they attend to.

    cu_seqlens_q [B + 1]: new tokens per sequence; seq_lens [B]: each sequence's length after
    the step; block_table [B, max_blocks]; slot_mapping [T]: the cache slot of each new token."""

    cu_seqlens_q: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor


def build_step(spans: list[tuple[list[int], int, int]], block_size: int,
               device: torch.device | str = "cpu") -> tuple[CacheStep, Tensor]:
    """The CacheStep of one call that computes, for each sequence, positions [start, stop), given its
    blocks (enough for stop tokens). spans: (blocks, start, stop) per sequence, in call order.
    Returns (step, positions [T] int64 of the new tokens)."""
    if not spans:
        raise ValueError("spans: expected at least one sequence")
    cu, lens, slots, positions = [0], [], [], []
    width = max(len(blocks) for blocks, _, _ in spans)
    table = torch.zeros((len(spans), max(1, width)), dtype=torch.int64)
    for i, (blocks, start, stop) in enumerate(spans):
        if not 0 <= start < stop or len(blocks) * block_size < stop:
            raise ValueError(f"spans: sequence {i} asks for positions [{start}, {stop}) with {len(blocks)} blocks "
                             f"of {block_size}")
        span = range(start, stop)
        positions.extend(span)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        cu.append(cu[-1] + stop - start)
        lens.append(stop)
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    step = CacheStep(torch.tensor(cu), torch.tensor(lens), table.to(device), torch.tensor(slots, device=device))
    return step, torch.tensor(positions, dtype=torch.int64, device=device)


def gather_packed(cache: Tensor, block_table: Tensor, seq_lens: list[int]) -> Tensor:
    """Every sequence's cached rows, packed: [sum(seq_lens), Hkv, D], in one indexed read."""
    block_size = cache.shape[1]
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=cache.device)
    starts = torch.cumsum(lens, 0) - lens
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=cache.device), lens)
    pos = torch.arange(int(lens.sum()), device=cache.device) - torch.repeat_interleave(starts, lens)
    slots = block_table.long().to(cache.device)[seq, pos // block_size] * block_size + pos % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]
