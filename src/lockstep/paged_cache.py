"""The paged KV cache's layout, shared by every reader and writer of it (docs/adr/0003-paged-kv-cache-layout.md).

A layer's cache is [num_blocks, block_size, kv_heads, head_dim]; a sequence's block table lists its
blocks in order, so its token at position p lives in slot table[p // block_size] * block_size +
p % block_size. `build_step` turns "these sequences, these positions" into the inputs of one
`Transformer.forward_cached` call; the engine, the harness and the parity tools all use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .rotary import MAX_POSITION, Positions, TablePositions


@dataclass(frozen=True)
class StepHost:
    """The host's copy of a step that `build_step` built and checked: what the ops need to know of
    the step's values, so that none of them reads the device back (on a GPU each read would wait
    for it). cu_seqlens_q and seq_lens as in CacheStep; positions of the new tokens; input_ids [T]
    on the step's device when build_step was given the tokens (checked below vocab_size); the
    block size and the number of cache blocks the step needs (its highest block id + 1); the block
    table [B, max_blocks] and slot mapping [T] it made (views of the one transfer)."""

    cu_seqlens_q: tuple[int, ...]  # tuples: a backend may keep what it derived from them for the
    seq_lens: tuple[int, ...]      # step's other layers, which holds only while they cannot change
    positions: Positions | TablePositions
    block_size: int
    blocks_needed: int
    block_table: Tensor             # the tensors build_step made and checked: a step holding others
    slot_mapping: Tensor            # (dataclasses.replace, an assignment) is checked by reading them
    input_ids: Tensor | None = None
    vocab_size: int | None = None
    # cu_seqlens_q [B + 1], seq_lens [B] and the block table [B, max_blocks] again, in int32 on the
    # step's device (the same transfer): what a GPU kernel reads, in fewer registers than int64.
    indices32: tuple[Tensor, Tensor, Tensor] | None = None


@dataclass
class CacheStep:
    """Where the new tokens of one `forward_cached` call go and what they attend to.

    cu_seqlens_q [B + 1]: new tokens per sequence; seq_lens [B]: each sequence's length after
    the step; block_table [B, max_blocks]; slot_mapping [T]: the cache slot of each new token; all
    int64. host: the checked host copy when `build_step` made the step (None for a step made by
    hand, whose values the ops check by reading them)."""

    cu_seqlens_q: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    host: StepHost | None = field(default=None, repr=False)


def build_step(spans: list[tuple[list[int], int, int]], block_size: int, device: torch.device | str = "cpu",
               tokens: Sequence[int] | None = None, vocab_size: int | None = None, *, width: int | None = None,
               into: Tensor | None = None, positions_below: int | None = None) -> tuple[CacheStep, Tensor]:
    """The CacheStep of one call that computes, for each sequence, positions [start, stop), given its
    blocks (enough for stop tokens). spans: (blocks, start, stop) per sequence, in call order;
    tokens: the T new tokens' ids (optional), each in [0, vocab_size). Everything is checked here,
    on the host, and moved to `device` in one transfer. Returns (step, positions [T] int64 of the
    new tokens); with tokens, step.host.input_ids holds them as a [T] int64 tensor.

    width: the block table's columns (default: the most blocks of a sequence). into: a flat int64
    tensor of step_size(...) elements that receives the transfer, so that the step's tensors are
    views of it (static buffers that a captured graph reads); by default the step gets new ones.
    Each view starts a multiple of 16 bytes into the buffer, so every view is 16-byte aligned when
    `into` is (a tensor of its own, as torch.empty makes, always is): Triton compiles a kernel again
    for pointers that are not.
    positions_below: a bound of every position (checked here): the step's positions are then a
    rotary.TablePositions, whose angles rope gathers on the device, instead of a host copy."""
    if not spans:
        raise ValueError("spans: expected at least one sequence")
    if positions_below is not None and (isinstance(positions_below, bool) or not isinstance(positions_below, int)
                                        or not 1 <= positions_below <= MAX_POSITION):
        raise ValueError(f"positions_below: expected an int in [1, 2^24 = {MAX_POSITION}], got {positions_below!r}")
    cu, lens, slots, positions = [0], [], [], []
    widest = max(1, max(len(blocks) for blocks, _, _ in spans))
    if width is None:
        width = widest
    elif isinstance(width, bool) or not isinstance(width, int) or width < widest:
        raise ValueError(f"width: expected an int of at least {widest} (the most blocks of a sequence), got {width!r}")
    used: list[int] = []                       # the block ids, row by row, and where they go
    where_used: list[int] = []
    for i, (blocks, start, stop) in enumerate(spans):
        if not 0 <= start < stop or len(blocks) * block_size < stop:
            raise ValueError(f"spans: sequence {i} asks for positions [{start}, {stop}) with {len(blocks)} blocks "
                             f"of {block_size}")
        if stop > MAX_POSITION:
            raise ValueError(f"spans: sequence {i} reaches position {stop - 1}, beyond rope's 2^24 = {MAX_POSITION}")
        if positions_below is not None and stop > positions_below:
            raise ValueError(f"spans: sequence {i} reaches position {stop - 1}, not below positions_below = "
                             f"{positions_below}")
        if any(not isinstance(b, int) or not 0 <= b < 2 ** 31 for b in blocks):
            raise ValueError(f"spans: sequence {i} has a block id that is not an int in [0, 2^31): {list(blocks)[:8]}")
        span = range(start, stop)
        positions.extend(span)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        cu.append(cu[-1] + stop - start)
        lens.append(stop)
        used.extend(blocks)
        where_used.extend(range(i * width, i * width + len(blocks)))
    if len(set(slots)) != len(slots):
        raise ValueError("spans: two new tokens would be written to the same cache slot")
    ids = [] if tokens is None else list(tokens)
    if tokens is not None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"vocab_size: expected a positive int with the tokens, got {vocab_size!r}")
        if len(ids) != len(positions):
            raise ValueError(f"tokens: expected {len(positions)} ids (one per new token), got {len(ids)}")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"tokens: expected ids in [0, {vocab_size}), got {bad[:5]}")
    b, t = len(spans), len(positions)
    # The table is filled by tensor ops: a static step's is as wide as the longest sequence the
    # cache can hold, mostly zeros, and Python would spend a loop on each of them.
    table = torch.zeros(b * width, dtype=torch.int64)
    if used:
        table[torch.tensor(where_used)] = torch.tensor(used, dtype=torch.int64)
    # One host buffer, one transfer; the step's tensors are views of the device's copy, the int32
    # copies after the int64 ones. Each view starts on a 16-byte boundary whatever the step's size:
    # Triton specializes a kernel on its pointers' alignment, and a batch-dependent alignment would
    # compile a second attention binary for some batch sizes.
    wide = [torch.tensor(x, dtype=torch.int64) for x in (cu, lens, slots, positions, ids)] + [table]
    narrow = [torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), table.to(torch.int32)]
    host = torch.cat([_padded(x) for x in wide] + [_padded(x).view(torch.int64) for x in narrow])
    if into is None:
        moved = host.to(device)
    elif not isinstance(into, Tensor) or into.dtype != torch.int64 or tuple(into.shape) != tuple(host.shape):
        raise ValueError(f"into: expected a flat int64 tensor of {host.numel()} elements (this step's layout), got "
                         f"{tuple(into.shape) if isinstance(into, Tensor) else type(into).__name__}")
    elif into.device.type != torch.device(device).type or torch.device(device).index not in (None, into.device.index):
        raise ValueError(f"into: expected a tensor on {torch.device(device)} (device), got one on {into.device}")
    else:
        moved = into.copy_(host)
    split = sum(_padded_length(len(x), 8) for x in wide)
    parts = _segments(moved[:split], wide) + _segments(moved[split:].view(torch.int32), narrow)
    cu32, lens32, table32 = parts[6:]
    where = Positions(parts[3], tuple(positions)) if positions_below is None else TablePositions(parts[3],
                                                                                               positions_below)
    checked = StepHost(tuple(cu), tuple(lens), where, block_size, max(used, default=0) + 1,
                       parts[5].view(b, width), parts[2], parts[4] if tokens is not None else None,
                       vocab_size if tokens is not None else None, (cu32, lens32, table32.view(b, width)))
    step = CacheStep(parts[0], parts[1], checked.block_table, parts[2], checked)
    return step, parts[3]


# Every view of build_step's flat buffer starts at a multiple of this many bytes (Triton's
# divisibility specialization), given a buffer that does: PyTorch's allocators align far more.
_ALIGN = 16


def _padded_length(count: int, itemsize: int) -> int:
    """`count` items of `itemsize` bytes, rounded up to a multiple of _ALIGN bytes."""
    per = _ALIGN // itemsize
    return -(-count // per) * per


def _padded(x: Tensor) -> Tensor:
    """x with zeros after it, to a multiple of _ALIGN bytes."""
    return torch.cat([x, x.new_zeros(_padded_length(len(x), x.element_size()) - len(x))])


def _segments(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Views of `flat` as long as each of `like`, each one's start padded as `_padded` pads it."""
    views, at = [], 0
    for x in like:
        views.append(flat[at:at + len(x)])
        at += _padded_length(len(x), x.element_size())
    return views


def step_size(sequences: int, tokens: int, width: int, with_ids: bool = True) -> int:
    """The elements of build_step's flat int64 layout for `sequences` sequences, `tokens` new tokens
    and a block table `width` blocks wide (`into`'s size)."""
    int64s = [sequences + 1, sequences, tokens, tokens, tokens if with_ids else 0, sequences * width]
    int32s = [sequences + 1, sequences, sequences * width]
    return sum(_padded_length(n, 8) for n in int64s) + sum(_padded_length(n, 4) // 2 for n in int32s)


def gather_packed(cache: Tensor, block_table: Tensor, seq_lens: list[int]) -> Tensor:
    """Every sequence's cached rows, packed: [sum(seq_lens), Hkv, D], in one indexed read."""
    block_size = cache.shape[1]
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=cache.device)
    starts = torch.cumsum(lens, 0) - lens
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=cache.device), lens)
    pos = torch.arange(int(lens.sum()), device=cache.device) - torch.repeat_interleave(starts, lens)
    slots = block_table.long().to(cache.device)[seq, pos // block_size] * block_size + pos % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]
