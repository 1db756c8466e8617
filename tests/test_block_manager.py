"""lockstep.engine.block_manager on its own: reference counts, prefix sharing by name, the free list.

Every test ends each change with `check_invariants`, which compares the manager's books with the
blocks the sequences actually hold; test_scheduler.py uses it after every scheduled step."""

from __future__ import annotations

from collections import Counter

import pytest

from lockstep import SamplingParams
from lockstep.engine.block_manager import BlockManager, block_hash
from lockstep.engine.sequence import RequestOutput, Sequence


def make_seq(tokens: list[int], request_id: int = 0) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(), RequestOutput(request_id, list(tokens)))


def prefix_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The names of every full block of `tokens`, by the definition (each hashes its parent's name)."""
    names, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        names.append(parent)
    return names


def check_invariants(bm: BlockManager, holders: list[Sequence]) -> None:
    """The manager's books agree with what `holders` (every sequence with blocks) hold: a block's
    count is its number of holders, the free list is exactly the blocks no one holds, names and
    blocks map one to one, a named block holds the prefix its name says for everyone holding it,
    and only a live holder claims a name in flight."""
    held = Counter(b for s in holders for b in s.blocks)
    for s in holders:
        assert len(set(s.blocks)) == len(s.blocks), f"a sequence holds a block twice: {s.blocks}"
    assert bm.ref == [held[b] for b in range(bm.num_blocks)], "reference counts differ from the holders"
    assert list(bm.free) == [b for b in bm.free if held[b] == 0], "a held block is on the free list"
    assert set(bm.free) == {b for b in range(bm.num_blocks) if held[b] == 0}, "a block no one holds is lost"
    assert bm.num_free == len(bm.free)
    assert bm.by_name == {n: b for b, n in enumerate(bm.name) if n is not None}, "names and blocks disagree"
    for s in holders:
        names = prefix_hashes(s.tokens, bm.block_size)
        for i, b in enumerate(s.blocks):
            if bm.name[b] is not None:
                assert i < len(names) and bm.name[b] == names[i], f"block {b} is named for another prefix"
    assert set(bm.inflight.values()) <= {id(s) for s in holders}, "a name in flight belongs to no holder"


def compute(bm: BlockManager, seq: Sequence, upto: int) -> None:
    """What a model step does to a sequence's blocks: room for `upto` tokens, computed, then named."""
    assert bm.grow(seq, upto)
    seq.computed = upto
    bm.name_full_blocks(seq)


def test_fresh_blocks_are_handed_out_least_recently_freed_first():
    bm = BlockManager(6, 4)
    a = make_seq(list(range(10)))
    assert bm.blocks_needed(a, 10) == 3
    assert bm.grow(a, 10) and a.blocks == [0, 1, 2]
    assert bm.ref == [1, 1, 1, 0, 0, 0] and list(bm.free) == [3, 4, 5]
    assert bm.grow(a, 12) and a.blocks == [0, 1, 2], "12 tokens fit in the 3 blocks held"
    check_invariants(bm, [a])
    bm.release(a)
    assert a.blocks == [] and list(bm.free) == [3, 4, 5, 2, 1, 0], "released last block first, at the back"
    b = make_seq([7])
    assert bm.grow(b, 1) and b.blocks == [3]
    check_invariants(bm, [b])


def share_and_release(bm: BlockManager) -> None:
    """Two sequences with the same 8-token prefix (block size 4), the second sharing the first's two
    named blocks; then each lets go. Checks the books after every change."""
    a = make_seq(list(range(10)))
    b = make_seq(list(range(8)) + [99, 98, 97])
    assert bm.reuse_prefix(a) == 0
    compute(bm, a, 10)
    check_invariants(bm, [a])
    assert bm.reuse_prefix(b) == 8 and b.blocks == a.blocks[:2]
    assert bm.ref[a.blocks[0]] == bm.ref[a.blocks[1]] == 2
    assert bm.hits == 8, "the hit counter counts the prompt tokens served from the cache"
    compute(bm, b, 11)
    check_invariants(bm, [a, b])
    shared, own = a.blocks[:2], a.blocks[2]
    bm.release(a)
    check_invariants(bm, [b])
    assert all(blk not in bm.free and bm.ref[blk] == 1 for blk in shared), "b still holds the shared blocks"
    assert list(bm.free)[-1] == own
    bm.release(b)
    check_invariants(bm, [])
    assert bm.num_free == bm.num_blocks


def test_a_second_sequence_with_the_same_prefix_shares_its_blocks_until_both_let_go():
    share_and_release(BlockManager(8, 4))


def test_release_that_forgets_a_shared_blocks_count_is_caught(monkeypatch: pytest.MonkeyPatch):
    """Planted fault: a release that leaves a shared block's count alone leaks the block."""
    def release(self: BlockManager, seq: Sequence) -> None:
        for block in reversed(seq.blocks):
            if self.ref[block] == 1:                   # wrong: a shared block keeps its count
                self.ref[block] = 0
                self.free[block] = None
        seq.blocks = []

    monkeypatch.setattr(BlockManager, "release", release)
    with pytest.raises(AssertionError, match="reference counts differ"):
        share_and_release(BlockManager(8, 4))


def test_a_freed_block_keeps_its_name_until_it_is_handed_out_again():
    bm = BlockManager(3, 4)
    a = make_seq(list(range(9)))
    bm.reuse_prefix(a)
    compute(bm, a, 9)
    first, second = a.blocks[:2]
    bm.release(a)
    check_invariants(bm, [])
    again = make_seq(list(range(9)))
    assert bm.reuse_prefix(again) == 8 and again.blocks == [first, second], "freed blocks are still found by name"
    assert bm.hits == 8
    bm.release(again)
    filler = make_seq([5] * 12)
    assert bm.grow(filler, 12) and sorted(filler.blocks) == [0, 1, 2]
    assert bm.by_name == {} and bm.name == [None] * 3, "a block handed out for other tokens loses its name"
    check_invariants(bm, [filler])
    bm.release(filler)
    assert bm.reuse_prefix(make_seq(list(range(9)))) == 0


def test_name_full_blocks_names_only_computed_full_blocks_and_the_first_block_with_a_name_keeps_it():
    bm = BlockManager(8, 4)
    a, b = make_seq(list(range(11))), make_seq(list(range(11)))
    assert bm.grow(a, 11) and bm.grow(b, 11)
    a.computed = 7
    bm.name_full_blocks(a)
    assert [bm.name[x] for x in a.blocks] == prefix_hashes(a.tokens, 4)[:1] + [None, None]
    a.computed = b.computed = 11
    bm.name_full_blocks(b)
    bm.name_full_blocks(a)
    assert bm.by_name == dict(zip(prefix_hashes(b.tokens, 4), [a.blocks[0], b.blocks[1]]))
    check_invariants(bm, [a, b])


def test_prefix_names_leave_out_the_block_of_the_last_token():
    """The last token must run to give the logits of the next one, so its block is never reused."""
    bm = BlockManager(8, 4)
    assert bm.prefix_names(make_seq(list(range(8)))) == prefix_hashes(list(range(8)), 4)[:1]
    assert bm.prefix_names(make_seq(list(range(9)))) == prefix_hashes(list(range(9)), 4)
    assert bm.prefix_names(make_seq(list(range(4)))) == []
    a = make_seq(list(range(8)))
    bm.reuse_prefix(a)
    compute(bm, a, 8)
    assert bm.reuse_prefix(make_seq(list(range(8)))) == 4


def test_must_wait_while_another_sequence_computes_the_prefix():
    bm = BlockManager(8, 4)
    a, b = make_seq(list(range(10))), make_seq(list(range(9)) + [50])
    assert not bm.must_wait(a)
    assert bm.reuse_prefix(a) == 0
    assert set(bm.inflight) == set(prefix_hashes(a.tokens, 4)[:2]) and set(bm.inflight.values()) == {id(a)}
    assert not bm.must_wait(a), "a sequence never waits for itself"
    assert bm.must_wait(b)
    compute(bm, a, 10)
    assert bm.inflight == {}
    assert not bm.must_wait(b)
    assert bm.reuse_prefix(b) == 8
    check_invariants(bm, [a, b])


def test_release_drops_the_names_a_sequence_claimed_in_flight():
    bm = BlockManager(8, 4)
    a, b = make_seq(list(range(10))), make_seq(list(range(10)))
    bm.reuse_prefix(a)
    assert bm.grow(a, 10) and bm.must_wait(b)
    bm.release(a)                                     # preempted before its step ran
    assert bm.inflight == {} and not bm.must_wait(b)
    check_invariants(bm, [])


def test_without_prefix_caching_nothing_is_shared_or_waited_for():
    bm = BlockManager(8, 4, prefix_caching=False)
    a, b = make_seq(list(range(10))), make_seq(list(range(10)))
    assert bm.reuse_prefix(a) == 0 and bm.inflight == {}
    compute(bm, a, 10)
    assert bm.by_name == {} and not bm.must_wait(b) and bm.reuse_prefix(b) == 0 and bm.hits == 0
    compute(bm, b, 10)
    assert not set(a.blocks) & set(b.blocks)
    check_invariants(bm, [a, b])


def test_forget_prefixes_drops_every_name_and_claim_but_no_hold():
    bm = BlockManager(8, 4)
    a, b = make_seq(list(range(10))), make_seq(list(range(20, 30)))
    bm.reuse_prefix(a)
    compute(bm, a, 10)
    bm.reuse_prefix(b)                                 # b's names are in flight
    assert bm.grow(b, 10) and bm.inflight
    refs, free = list(bm.ref), list(bm.free)
    bm.forget_prefixes()
    assert bm.by_name == {} and bm.inflight == {} and bm.name == [None] * 8
    assert bm.ref == refs and list(bm.free) == free, "who holds which block does not change"
    check_invariants(bm, [a, b])
    assert bm.reuse_prefix(make_seq(list(range(10)))) == 0


def test_grow_fails_when_the_cache_is_full_and_changes_nothing():
    bm = BlockManager(3, 4)
    a, b = make_seq(list(range(8))), make_seq(list(range(30, 37)))
    assert bm.grow(a, 8) and bm.num_free == 1
    assert not bm.grow(b, 7), "2 blocks needed, 1 free"
    assert b.blocks == [] and bm.num_free == 1 and bm.ref == [1, 1, 0]
    assert bm.grow(b, 4) and not bm.grow(b, 5)
    assert b.blocks == [2] and bm.num_free == 0
    check_invariants(bm, [a, b])


def test_reuse_prefix_refuses_a_sequence_that_holds_blocks():
    bm = BlockManager(4, 4)
    a = make_seq(list(range(6)))
    assert bm.grow(a, 6)
    with pytest.raises(ValueError, match=r"reuse_prefix: the sequence already holds blocks \[0, 1\]"):
        bm.reuse_prefix(a)
