"""The paged KV cache's layout, shared by every reader of it (docs/adr/0003-paged-kv-cache-layout.md).

A layer's cache is [num_blocks, block_size, kv_heads, head_dim]; a sequence's block table lists its
blocks in order, so its token at position p lives in slot table[p // block_size] * block_size +
p % block_size.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_packed(cache: Tensor, block_table: Tensor, seq_lens: list[int]) -> Tensor:
    """Every sequence's cached rows, packed: [sum(seq_lens), Hkv, D], in one indexed read."""
    block_size = cache.shape[1]
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=cache.device)
    starts = torch.cumsum(lens, 0) - lens
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=cache.device), lens)
    pos = torch.arange(int(lens.sum()), device=cache.device) - torch.repeat_interleave(starts, lens)
    slots = block_table.long().to(cache.device)[seq, pos // block_size] * block_size + pos % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]
