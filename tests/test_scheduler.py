"""lockstep.engine.scheduler on its own, driven by a fake model step instead of a model.

The fake step writes, for every token it computes, the token prefix that token's keys and values
would depend on into a fake cache slot, and before it draws a token it reads back every slot the
sequence's attention would read: a block shared wrongly, overwritten while held, or lost in a
preemption shows up there. The drawn token is a pure function of the sequence's tokens, so a run
under any setting must give the tokens of a run with room for everything. `check_step` holds every
plan to the scheduler's promises; the block books are held to test_block_manager's
`check_invariants`."""

from __future__ import annotations

import pytest
from test_block_manager import check_invariants

from lockstep import SamplingParams
from lockstep.engine.block_manager import BlockManager
from lockstep.engine.scheduler import Scheduler
from lockstep.engine.sequence import RequestOutput, Sequence

Plan = list[tuple[Sequence, int]]


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
         prefix_caching: bool = True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix_caching), max_num_seqs, budget)


def make_seq(request_id: int, prompt: list[int], max_new: int, index: int = 0) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(max_new_tokens=max_new),
                    RequestOutput(request_id, list(prompt), index=index))


def next_token(tokens: list[int]) -> int:
    """The fake model: a pure function of the whole sequence, so any lost or wrong token shows."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + 3) % 101


def check_step(sched: Scheduler, plan: Plan) -> None:
    """What every plan promises: at most max_num_seqs run and the plan stays within the token
    budget; each planned sequence appears once, in running order, with 1 to `remaining` tokens and
    blocks for them; a sequence gets fewer than its remaining tokens only when the budget is spent;
    a waiting sequence holds no blocks; and the block books are right."""
    bs = sched.blocks.block_size
    seqs = [s for s, _ in plan]
    used = sum(n for _, n in plan)
    assert used <= sched.budget, f"the plan exceeds the token budget: {used} > {sched.budget}"
    assert len(sched.running) <= sched.max_num_seqs, "more sequences run than max_num_seqs"
    assert len({id(s) for s in seqs}) == len(seqs), "a sequence is planned twice"
    assert [s for s in sched.running if any(s is p for p in seqs)] == seqs, "the plan is not in running order"
    for s, n in plan:
        assert 1 <= n <= s.remaining, f"{n} tokens planned, {s.remaining} pending"
        assert n == s.remaining or used == sched.budget, "a prefill is cut while budget is left"
        assert len(s.blocks) * bs >= s.computed + n, "a planned sequence has no room for its tokens"
    for s in sched.waiting:
        assert not s.blocks and not any(s is r for r in sched.running), "a waiting sequence holds blocks"
    check_invariants(sched.blocks, sched.running)


class Run:
    """A scheduler driven by the fake model step, checked after every step."""

    def __init__(self, sched: Scheduler, fifo: bool = True):
        self.sched, self.fifo = sched, fifo
        self.slots: dict[int, tuple[int, ...]] = {}
        self.finished: list[Sequence] = []
        self.plans: list[list[tuple[int, int, int]]] = []       # (request_id, index, tokens) per step

    def step(self) -> Plan:
        sched, bs = self.sched, self.sched.blocks.block_size
        queue = list(sched.running) + list(sched.waiting)
        plan = sched.schedule()
        check_step(sched, plan)
        if self.fifo:     # admission takes the front of the queue, preemption puts the newest back there
            assert list(sched.running) + list(sched.waiting) == queue, "the arrival order changed"
        for seq, n in plan:
            for p in range(seq.computed, seq.computed + n):
                block = seq.blocks[p // bs]
                assert sched.blocks.ref[block] == 1, "a step writes into a block another sequence shares"
                self.slots[block * bs + p % bs] = tuple(seq.tokens[:p + 1])
            seq.computed += n
            if seq.remaining == 0:
                for p in range(seq.computed):             # every key and value attention reads
                    assert self.slots.get(seq.blocks[p // bs] * bs + p % bs) == tuple(seq.tokens[:p + 1]), \
                        f"position {p} of request {seq.request_id} reads another token's keys"
                seq.out.token_ids.append(next_token(seq.tokens))
                if len(seq.out.token_ids) == seq.params.max_new_tokens:
                    sched.finish(seq)
                    self.finished.append(seq)
        sched.postprocess(plan)
        check_invariants(sched.blocks, sched.running)
        self.plans.append([(s.request_id, s.index, n) for s, n in plan])
        return plan

    def until_done(self, limit: int = 1000) -> list[Sequence]:
        for _ in range(limit):
            if not self.sched.has_unfinished():
                assert self.sched.blocks.num_free == self.sched.blocks.num_blocks, "a block was never released"
                return self.finished
            self.step()
        raise AssertionError(f"not done after {limit} steps")


def prompts(lengths: list[int]) -> list[list[int]]:
    return [[(17 * r + 5 * i) % 97 for i in range(k)] for r, k in enumerate(lengths)]


def run_all(sched: Scheduler, lengths: list[int], max_new: int) -> tuple[Run, dict[int, list[int]]]:
    run = Run(sched)
    for r, p in enumerate(prompts(lengths)):
        sched.add(make_seq(r, p, max_new))
    return run, {s.request_id: s.out.token_ids for s in run.until_done()}


def test_admission_in_arrival_order_up_to_max_num_seqs():
    sched = make(max_num_seqs=2)
    run = Run(sched)
    for r, p in enumerate(prompts([5, 3, 6, 2])):
        sched.add(make_seq(r, p, 2))
    assert run.step() and [s.request_id for s in sched.running] == [0, 1]
    assert [s.request_id for s in sched.waiting] == [2, 3]
    assert run.plans == [[(0, 0, 5), (1, 0, 3)]]
    assert [s.request_id for s in run.until_done()] == [0, 1, 2, 3]
    assert run.plans[1:] == [[(0, 0, 1), (1, 0, 1)], [(2, 0, 6), (3, 0, 2)], [(2, 0, 1), (3, 0, 1)]]


def test_the_token_budget_cuts_a_prefill_into_chunks():
    run, out = run_all(make(budget=4), [10], 2)
    assert run.plans == [[(0, 0, 4)], [(0, 0, 4)], [(0, 0, 2)], [(0, 0, 1)]]
    assert out == run_all(make(), [10], 2)[1]


def test_the_budget_is_shared_in_running_order_and_does_not_limit_admission():
    sched = make(budget=8)
    run = Run(sched)
    for r, p in enumerate(prompts([6, 3, 5])):
        sched.add(make_seq(r, p, 2))
    run.step()
    assert [s.request_id for s in sched.running] == [0, 1, 2], "admitted, though the budget plans 2"
    run.until_done()
    assert run.plans == [[(0, 0, 6), (1, 0, 2)], [(0, 0, 1), (1, 0, 1), (2, 0, 5)], [(1, 0, 1), (2, 0, 1)]]


@pytest.mark.parametrize("budget, max_num_seqs", [(64, 8), (5, 8), (64, 1), (3, 2)])
def test_preemption_recomputes_the_newest_sequence_and_loses_nothing(budget: int, max_num_seqs: int):
    lengths, max_new = [6, 9, 2, 7, 5], 6
    _, roomy = run_all(make(), lengths, max_new)
    sched = make(num_blocks=5, budget=budget, max_num_seqs=max_num_seqs)     # 3 to 4 blocks per request
    run, tight = run_all(sched, lengths, max_new)
    assert tight == roomy
    assert sched.preemptions > 0 or max_num_seqs == 1


def test_a_preempted_sequence_waits_at_the_front_with_nothing_computed():
    sched = make(num_blocks=5)
    run = Run(sched)
    a, b = make_seq(0, prompts([8])[0], 8), make_seq(1, prompts([0, 7])[1], 8)
    sched.add(a)
    sched.add(b)
    run.step()                                        # a and b hold 2 blocks each
    assert [s.request_id for s in sched.running] == [0, 1] and sched.blocks.num_free == 1
    while not sched.preemptions:
        run.step()
    assert list(sched.running) == [a] and list(sched.waiting) == [b]
    assert b.blocks == [] and b.computed == 0 and len(b.out.token_ids) > 0, "b keeps its tokens"
    assert run.until_done() == [a, b]


def test_finish_and_abort_release_every_block():
    sched = make(max_num_seqs=3)
    run = Run(sched, fifo=False)                          # request 0's second completion waits a step
    p = prompts([9, 6, 5])
    for i in range(2):
        sched.add(make_seq(0, p[0], 50, index=i))       # two completions of request 0
    sched.add(make_seq(1, p[1], 1))
    sched.add(make_seq(2, p[2], 50))
    run.step()
    assert [s.request_id for s in run.finished] == [1], "request 1 finished and freed its blocks"
    assert [(s.request_id, s.index) for s in sched.running] == [(0, 0), (2, 0)]
    assert [(s.request_id, s.index) for s in sched.waiting] == [(0, 1)]
    run.step()
    assert [(s.request_id, s.index) for s in sched.running] == [(0, 0), (2, 0), (0, 1)]
    own = {b for s in sched.running if s.request_id == 2 for b in s.blocks}
    gone = sched.abort(0)
    assert [s.index for s in gone] == [0, 1] and all(s.blocks == [] for s in gone)
    assert [s.request_id for s in sched.running] == [2]
    assert sched.blocks.num_free == sched.blocks.num_blocks - len(own), "request 0's shared blocks are free"
    check_invariants(sched.blocks, sched.running)
    sched.add(make_seq(3, p[0], 5))
    assert [s.request_id for s in sched.abort(3)] == [3], "a waiting sequence is aborted too"
    assert [s.request_id for s in sched.abort(2)] == [2] and not sched.has_unfinished()
    assert sched.blocks.num_free == sched.blocks.num_blocks


def test_completions_of_one_prompt_wait_a_step_and_share_its_blocks():
    sched = make()
    run = Run(sched, fifo=False)
    prompt = prompts([10])[0]
    seqs = [make_seq(0, prompt, 3, index=i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.add(make_seq(1, prompts([0, 5])[1], 3))
    run.step()
    assert run.plans == [[(0, 0, 10), (1, 0, 5)]], "the others wait for the prompt's blocks"
    run.step()
    assert run.plans[1] == [(0, 0, 1), (1, 0, 1), (0, 1, 2), (0, 2, 2)]
    assert [s.out.cached_tokens for s in seqs] == [0, 8, 8] and sched.blocks.hits == 16
    assert seqs[1].blocks[:2] == seqs[2].blocks[:2] == seqs[0].blocks[:2]
    assert {s.index: s.out.token_ids for s in run.until_done() if s.request_id == 0} == \
           {i: run_all(make(prefix_caching=False), [10], 3)[1][0] for i in range(3)}


def test_forget_prefixes_waits_for_an_empty_scheduler():
    sched = make()
    prompt = prompts([10])[0]
    sched.add(make_seq(0, prompt, 2))
    with pytest.raises(RuntimeError, match="forget_prefixes: sequences are waiting or running"):
        sched.forget_prefixes()
    Run(sched).until_done()
    sched.add(make_seq(1, prompt, 2))
    sched.schedule()
    assert sched.running[0].out.cached_tokens == 8
    sched.abort(1)
    sched.forget_prefixes()
    sched.add(make_seq(2, prompt, 2))
    sched.schedule()
    assert sched.running[0].out.cached_tokens == 0


def test_a_scheduler_that_overspends_the_budget_is_caught(monkeypatch: pytest.MonkeyPatch):
    """Planted fault: one token over the budget."""
    real = Scheduler.schedule

    def schedule(self: Scheduler) -> Plan:
        self.budget += 1
        try:
            return real(self)
        finally:
            self.budget -= 1

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    with pytest.raises(AssertionError, match="exceeds the token budget"):
        run_all(make(budget=5), [6, 9, 2], 3)


def test_a_preemption_that_keeps_its_blocks_is_caught(monkeypatch: pytest.MonkeyPatch):
    """Planted fault: the preempted sequence waits still holding its blocks and its claims in flight."""
    def preempt(self: Scheduler, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    with pytest.raises(AssertionError, match="a waiting sequence holds blocks|a name in flight belongs to no holder"):
        run_all(make(num_blocks=5), [6, 9, 2, 7, 5], 6)


def test_cached_tokens_counts_only_what_the_cache_saved_at_the_first_admission():
    """A sequence preempted mid-prefill (no token drawn yet) finds its own full blocks on
    re-admission; they were not saved by the cache, so cached_tokens stays what it first was."""
    sched = make(num_blocks=4, block_size=4, budget=2)
    run = Run(sched)
    a, b = make_seq(0, prompts([2, 8])[0], 10), make_seq(1, prompts([2, 8])[1], 4)
    sched.add(a)
    sched.add(b)
    computed_when_preempted = None
    for _ in range(300):
        if not sched.has_unfinished():
            break
        before, computed = sched.preemptions, b.computed
        run.step()
        if sched.preemptions > before and not b.out.token_ids and computed_when_preempted is None:
            computed_when_preempted = computed
    assert not sched.has_unfinished()
    assert computed_when_preempted is not None and computed_when_preempted >= 4, "the scenario needs that preemption"
    assert b.out.cached_tokens == 0
