"""The paged KV cache's blocks: who holds which, and which full blocks can be shared.

Every block has a reference count. A full block is named by a hash of its tokens and of the hash of
the block before it (so the name covers the whole prefix up to it); a new sequence whose prefix has
the same names reuses those blocks instead of computing them again. The keys and values of a token
depend only on the tokens up to it (split invariance), so a block computed for one sequence has the
bits any other sequence with that prefix would compute: sharing changes no bit.

A block whose count falls to zero goes back to the free list but keeps its name, so a later request
with the same prefix can still find it, until the block is handed out for other tokens. Blocks are
handed out least recently freed first.

A block is named once its keys and values are computed. Until then its name is "in flight", held by
the sequence computing it: a sequence whose prefix needs an in-flight block waits (`must_wait`),
and joins one step later with the block cached. So the n completions of a prompt compute the prompt
once.

Every change to a block's state (taken, shared by name, named when full, released, forgotten) is a
method here, and the Scheduler is the one caller of them all; everyone else only reads the counts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from ..numerics.fixed_order import ceil_div
from .sequence import Sequence


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block: its tokens and the name of the block before it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockManager:
    """num_blocks blocks of block_size tokens; prefix_caching shares full blocks by name."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref = [0] * num_blocks
        self.name: list[bytes | None] = [None] * num_blocks
        self.by_name: dict[bytes, int] = {}
        self.inflight: dict[bytes, int] = {}     # name -> id() of the sequence computing that block
        # Free blocks in the order they were freed (least recently freed first); a dict keeps O(1) removal.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hits = 0                      # prompt tokens served from the cache, since the start

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.name[block] is not None:          # its old tokens are about to be overwritten
            del self.by_name[self.name[block]]
            self.name[block] = None
        self.ref[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def prefix_names(self, seq: Sequence) -> list[bytes]:
        """The names of the sequence's full blocks, but never the block of its last token (that token
        must run, to give the logits of the next one)."""
        tokens, names, parent = seq.tokens, [], b""
        for start in range(0, len(tokens) - self.block_size, self.block_size):
            parent = block_hash(parent, tokens[start:start + self.block_size])
            names.append(parent)
        return names

    def must_wait(self, seq: Sequence) -> bool:
        """Whether the first block of `seq`'s prefix that is not cached is being computed by another
        sequence right now (then `seq` does better to start one step later)."""
        if not self.prefix_caching:
            return False
        for name in self.prefix_names(seq):
            if name not in self.by_name:
                return self.inflight.get(name, id(seq)) != id(seq)
        return False

    def reuse_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest named prefix, and claim the
        names of the rest of its prefix as in flight. Returns the number of tokens whose keys and
        values it now has."""
        if seq.blocks:
            raise ValueError(f"reuse_prefix: the sequence already holds blocks {seq.blocks[:8]}; only a sequence "
                             "with none (new, or preempted) takes a cached prefix")
        if not self.prefix_caching:
            return 0
        names = self.prefix_names(seq)
        for name in names:
            block = self.by_name.get(name)
            if block is None:
                break
            self._hold(block)
            seq.blocks.append(block)
        for name in names[len(seq.blocks):]:
            self.inflight.setdefault(name, id(seq))
        cached = len(seq.blocks) * self.block_size
        self.hits += cached
        return cached

    def blocks_needed(self, seq: Sequence, upto: int) -> int:
        return max(0, ceil_div(upto, self.block_size) - len(seq.blocks))

    def grow(self, seq: Sequence, upto: int) -> bool:
        """Give `seq` blocks for its first `upto` tokens; False (and nothing changed) if too few are free."""
        need = self.blocks_needed(seq, upto)
        if need > len(self.free):
            return False
        seq.blocks.extend(self._take() for _ in range(need))
        return True

    def name_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks of `seq` that its computed tokens fill, so later sequences can share them."""
        if not self.prefix_caching:
            return
        tokens = seq.tokens
        parent = b""
        for i in range(seq.computed // self.block_size):
            parent = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = seq.blocks[i]
            if self.name[block] is None and parent not in self.by_name:
                self.name[block] = parent
                self.by_name[parent] = block
            if self.inflight.get(parent) == id(seq):
                del self.inflight[parent]

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks (and its claims on names in flight); the last holder returns
        a block to the free list."""
        mine = [name for name, owner in self.inflight.items() if owner == id(seq)]
        for name in mine:
            del self.inflight[name]
        for block in reversed(seq.blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
        seq.blocks = []

    def forget_prefixes(self) -> None:
        """Drop every name (new weights make every cached key and value stale)."""
        self.by_name.clear()
        self.inflight.clear()
        self.name = [None] * self.num_blocks
