"""Which sequences run in the next step, and how many of their tokens; and, as the one caller of
the block manager, every change to the blocks of a sequence.

Sequences are admitted in arrival order while fewer than max_num_seqs run; an admitted sequence
first takes the cached blocks of its prefix, and one whose prefix another sequence is computing
right now waits a step to share it. Each step packs, in running order, every sequence's
pending tokens (a whole prefill, a chunk of it, or one decode token) under a budget of
max_num_batched_tokens. When the cache has too few free blocks, the most recently admitted sequence
is preempted: it lets go of its blocks and waits at the front of the queue, to be recomputed from its
prompt and the tokens it already has. None of this changes a bit of any sequence (docs/contract.md,
section 4).

A block's life runs through here alone, as in nano-vllm: `schedule` shares prefix blocks, grows
sequences and preempts; after the model step, `postprocess` names the blocks the step filled;
`finish` names a finished sequence's blocks and releases them, `abort` releases them, and
`forget_prefixes` drops every name when the weights change. The engine reads the block manager's
statistics and never changes it.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .sequence import Sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks, self.max_num_seqs, self.budget = blocks, max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute) for the next step, in running order."""
        held: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if self.blocks.must_wait(seq):            # its prefix is being computed: join a step later
                held.append(seq)
                continue
            seq.computed = self.blocks.reuse_prefix(seq)
            if not seq.admitted:                      # the first admission: report what the cache saved
                seq.out.cached_tokens = seq.computed  # (not blocks it computed itself before a preemption)
                seq.admitted = True
            self.running.append(seq)
        self.waiting.extendleft(reversed(held))
        plan: list[tuple[Sequence, int]] = []
        used = 0
        for seq in list(self.running):
            if seq not in self.running or used == self.budget:
                continue
            n = min(seq.remaining, self.budget - used)
            # The victim is the last running sequence, so it comes after `seq` and is not planned yet.
            while not self.blocks.grow(seq, seq.computed + n):
                victim = self.running[-1]
                if victim is seq:
                    break
                self._preempt(victim)
            else:
                plan.append((seq, n))
                used += n
            # Alone and still no room: it waits for blocks that others free (add_request admits only
            # requests the whole cache can hold, so someone holds blocks).
        return plan

    def postprocess(self, plan: list[tuple[Sequence, int]]) -> None:
        """After the model step of `plan` (and `finish` of the sequences it ended): name the blocks
        the step filled, of every planned sequence that still holds blocks, so later sequences can
        share them."""
        for seq, _ in plan:
            if seq.blocks:
                self.blocks.name_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: its computed blocks keep their names for later prompts, and
        its hold on them goes."""
        self.blocks.name_full_blocks(seq)
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)

    def abort(self, request_id: int) -> list[Sequence]:
        """Remove every sequence of a request, wherever it is, releasing its blocks; returns them."""
        gone = [s for s in self.waiting if s.request_id == request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._drop(seq)
            gone.append(seq)
        return gone

    def forget_prefixes(self) -> None:
        """New weights make every cached key and value stale: no block is shared by name again.
        Nothing may be running."""
        if self.has_unfinished():
            raise RuntimeError("forget_prefixes: sequences are waiting or running; finish or abort them first")
        self.blocks.forget_prefixes()
