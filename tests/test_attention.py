import itertools

import pytest
import torch

import lockstep
from lockstep import contract, ops
from lockstep.backends import reference
from lockstep.harness.attention_check import AttnSizes, check_attention

from _contract_checks import assert_attention_report
from _native_helpers import isa  # noqa: F401  (fixture)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALL_SWEEPS = {"reversed order", "next to NaN/Inf sequences", "padding rows", "strided", "repeat (determinism)",
              "chunked prefill 1", "chunked prefill 7", "chunked prefill 16", "chunked prefill 100",
              "paged decode (staggered arrivals)", "threads=1 vs 2"}


def _assert_report(report, with_accuracy=True):
    assert_attention_report(report, ALL_SWEEPS, with_accuracy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_contract(dtype):
    _assert_report(check_attention(dtype))


@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(80, 4, 4), (96, 3, 1), (128, 8, 2), (256, 2, 1)])
def test_attention_head_dims_gqa_mqa(head_dim, q_heads, kv_heads):
    sizes = AttnSizes(lens=(70, 1, 129), q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, chunks=(1, 7, 16, 100))
    _assert_report(check_attention(torch.float32, sizes=sizes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_sliding_window(dtype):
    sizes = AttnSizes(lens=(150, 3, 90), window=40)
    _assert_report(check_attention(dtype, sizes=sizes))


def test_eager_sdpa_is_not_split_invariant():
    report = check_attention(torch.float32, backend="eager", with_accuracy=False)
    failed = {s.sweep for s in report.sweeps if not s.passed}
    assert "chunked prefill 1" in failed or "paged decode (staggered arrivals)" in failed


def test_attention_non_causal_and_custom_scale_match_reference():
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 2, 32), torch.randn(25, 1, 32), torch.randn(25, 1, 32)
    cq, ck = torch.tensor([0, 4, 10]), torch.tensor([0, 5, 25])
    got = ops.attention(q, k, v, cq, ck, scale=0.3, causal=False)
    torch.testing.assert_close(got.double(), reference.attention(q, k, v, cq, ck, scale=0.3, causal=False),
                               atol=1e-5, rtol=1e-5)


def test_attention_gradcheck_float64():
    torch.manual_seed(0)
    q = torch.randn(6, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 1, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 1, 8, dtype=torch.float64, requires_grad=True)
    cq, ck = torch.tensor([0, 2, 6]), torch.tensor([0, 5, 9])
    assert torch.autograd.gradcheck(lambda a, b, c: ops.attention(a, b, c, cq, ck, window=3), (q, k, v))


def test_paged_attention_equals_packed_attention_bitwise():
    torch.manual_seed(0)
    k_cache = torch.randn(10, 4, 2, 16)
    v_cache = torch.randn(10, 4, 2, 16)
    table = torch.tensor([[7, 2, 9], [0, 5, 0]])
    lens = torch.tensor([11, 6])
    q = torch.randn(3, 4, 16)
    cq = torch.tensor([0, 2, 3])
    got = ops.paged_attention(q, k_cache, v_cache, table, lens, cq)
    k = torch.cat([k_cache[[7, 2, 9]].reshape(-1, 2, 16)[:11], k_cache[[0, 5]].reshape(-1, 2, 16)[:6]])
    v = torch.cat([v_cache[[7, 2, 9]].reshape(-1, 2, 16)[:11], v_cache[[0, 5]].reshape(-1, 2, 16)[:6]])
    assert torch.equal(got, ops.attention(q, k, v, cq, torch.tensor([0, 11, 17])))


def _qkv():
    return torch.randn(4, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)


@pytest.mark.parametrize("call, message", [
    (lambda q, k, v: ops.attention(q, k, v, torch.tensor([0, 3, 2]), torch.tensor([0, 3, 6])),
     "cu_seqlens_q: expected non-decreasing offsets"),
    (lambda q, k, v: ops.attention(q, k, v, torch.tensor([0, 4]), torch.tensor([0, 3])),
     "cu_seqlens_q: sequence 0 has 4 queries but only 3 keys"),
    (lambda q, k, v: ops.attention(q, k, v, torch.tensor([0, 4]), torch.tensor([0, 7])),
     "cu_seqlens_k: last offset 7 exceeds the 6 rows of k"),
    (lambda q, k, v: ops.attention(q, k, v, torch.tensor([1, 4]), torch.tensor([0, 6])),
     "cu_seqlens_q: expected to start at 0"),
    (lambda q, k, v: ops.attention(q, k, v, torch.tensor([0, 4]), torch.tensor([0, 3, 6])),
     "cu_seqlens_k: expected 2 entries"),
    (lambda q, k, v: ops.attention(q, torch.randn(6, 3, 8), torch.randn(6, 3, 8), torch.tensor([0, 4]),
                                   torch.tensor([0, 6])), "k: expected a number of kv heads that divides q's 4 heads"),
    (lambda q, k, v: ops.attention(q, torch.randn(6, 2, 4), torch.randn(6, 2, 4), torch.tensor([0, 4]),
                                   torch.tensor([0, 6])), "k: expected head_dim 8"),
    (lambda q, k, v: ops.attention(q, k, v.half(), torch.tensor([0, 4]), torch.tensor([0, 6])),
     "v: expected dtype torch.float32"),
    (lambda q, k, v: ops.attention(q, k, v, torch.tensor([0, 4]), torch.tensor([0, 6]), window=0),
     "window: expected a positive int"),
    (lambda q, k, v: ops.attention(q, k, v, torch.tensor([0, 4.0]), torch.tensor([0, 6])),
     "cu_seqlens_q: expected an int64 or int32 tensor"),
])
def test_attention_bad_input(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call(*_qkv())


def test_paged_attention_block_table_outside_cache():
    cache = torch.zeros(3, 4, 1, 8)
    with pytest.raises(ValueError, match="block_table: sequence 0 points at block 5, outside the cache's 3 blocks"):
        ops.paged_attention(torch.randn(1, 1, 8), cache, cache, torch.tensor([[0, 5]]), torch.tensor([6]),
                            torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="block_table: sequence 0 needs 3 blocks for 9 keys"):
        ops.paged_attention(torch.randn(1, 1, 8), cache, cache, torch.tensor([[0, 1]]), torch.tensor([9]),
                            torch.tensor([0, 1]))


def test_write_kv_checks_slots():
    cache = torch.zeros(2, 4, 1, 8)
    k = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match=r"slot_mapping: expected values in \[0, 8\), found 8"):
        ops.write_kv(k, k, cache, cache.clone(), torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="slot_mapping: expected distinct slots"):
        ops.write_kv(k, k, cache, cache.clone(), torch.tensor([3, 3]))
    v_cache = cache.clone()
    ops.write_kv(k, k * 2, cache, v_cache, torch.tensor([5, 0]))
    assert torch.equal(cache[1, 1], k[0]) and torch.equal(v_cache[0, 0], 2 * k[1])


def test_attention_backend_is_selected_through_the_registry():
    q, k, v = _qkv()
    cq, ck = torch.tensor([0, 4]), torch.tensor([0, 6])
    with lockstep.use_backend("eager"):
        eager = ops.attention(q, k, v, cq, ck)
    torch.testing.assert_close(ops.attention(q, k, v, cq, ck), eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 16, 70, 140, 300, 9000])
def test_pairwise_weight_grad_is_its_stated_order_and_depends_on_the_rows_alone(rows):
    """fixed_order.pairwise_weight_grad (ADR 0033): LEAF_ROWS-row leaves, each one product, added pairwise,
    neighbours first, an odd last leaf passed up. Restated here leaf by leaf in fp32, bit for bit on
    the portable backend's torch path, and each batch entry's bits are those it gets alone. 9000 rows
    are 282 leaves: four whole CHUNK_LEAVES chunks and a part one, whose chunked products must add up
    to the one tree over all leaves."""
    from lockstep.numerics.fixed_order import LEAF_ROWS, pairwise_weight_grad

    gen = torch.Generator().manual_seed(rows)
    a, b = torch.randn(3, rows, 64, generator=gen), torch.randn(3, rows, 32, generator=gen)
    with lockstep.use_backend("portable"):
        got = pairwise_weight_grad(a, b)
        alone = pairwise_weight_grad(a[1:2].clone(), b[1:2].clone())
    assert torch.equal(got[1:2], alone)
    pad = -rows % LEAF_ROWS
    pa, pb = (torch.cat([x, x.new_zeros(3, pad, x.shape[-1])], 1) for x in (a, b))
    level = [torch.bmm(pa[:, s:s + LEAF_ROWS].transpose(1, 2), pb[:, s:s + LEAF_ROWS])
             for s in range(0, rows + pad, LEAF_ROWS)]
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)] + level[len(level) - len(level) % 2:]
    assert torch.equal(got, level[0])
    exact = torch.einsum("brn,brk->bnk", a.double(), b.double())
    tol = contract.tolerance("attention", torch.float32, "gradient")
    torch.testing.assert_close(got.double(), exact, atol=tol.atol, rtol=tol.rtol)


def test_pairwise_weight_grad_names_a_bad_shape():
    from lockstep.numerics.fixed_order import pairwise_weight_grad

    with pytest.raises(ValueError, match=r"grad_out, inp: expected 3-D tensors \[B, M, N\] and \[B, M, K\], "
                                         r"got shapes \(5, 4\) and \(5, 3\)"):
        pairwise_weight_grad(torch.ones(5, 4), torch.ones(5, 3))
    with pytest.raises(ValueError, match=r"inp: expected the batch and row counts of grad_out, \(2, 5\), got \(2, 6\)"):
        pairwise_weight_grad(torch.ones(2, 5, 4), torch.ones(2, 6, 3))


def _step_with_cache(dtype, positions_below=None, large=False):
    """A step of a prefill chunk and a decode token (large: an 80-token prefill chunk of 8 heads of
    64, enough for the rotation to run on several threads), with caches whose earlier slots hold
    keys and values already."""
    from lockstep.paged_cache import build_step

    gen = torch.Generator().manual_seed(8)
    spans, blocks, block_size, heads, dim = (([([3, 1], 0, 6), ([0], 2, 3)], 4, 4, (4, 2), 16) if not large else
                                             ([(list(range(6)), 0, 80), ([7], 0, 1)], 8, 16, (8, 2), 64))
    step, positions = build_step(spans, block_size, positions_below=positions_below)
    caches = [torch.randn(blocks, block_size, heads[1], dim, generator=gen).to(dtype) for _ in range(2)]
    tokens = positions.shape[0]
    q = torch.randn(tokens, heads[0], dim, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, heads[1], dim, generator=gen).to(dtype) for _ in range(2))
    return step, positions, caches, q, k, v


def _rotated_three_ways(dtype, style, below, large):
    """A step's cached attention with rope= (fused), after ops.rope on q and k (the ops), and with a
    step made by hand (the ops, inside): each (output, k cache, v cache)."""
    from lockstep.paged_cache import CacheStep
    from lockstep.rotary import Llama3RopeScaling, Rotation

    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    step, positions, (k_cache, v_cache), q, k, v = _step_with_cache(dtype, below, large)
    host = step.host.positions            # as the model passes them: Positions, or TablePositions
    outs = []
    for fused in (True, False, "by hand"):
        kc, vc = k_cache.clone(), v_cache.clone()
        with torch.no_grad():
            if fused is True:
                out = ops.cached_attention(q, k, v, kc, vc, step, rope=Rotation(host, 5e5, style, scaling))
            elif fused is False:
                qr, kr = (ops.rope(t, host, 5e5, style, scaling) for t in (q, k))
                out = ops.cached_attention(qr, kr, v, kc, vc, step)
            else:
                made = CacheStep(step.cu_seqlens_q.clone(), step.seq_lens.clone(), step.block_table.clone(),
                                 step.slot_mapping.clone())
                out = ops.cached_attention(q, k, v, kc, vc, made, rope=Rotation(positions.clone(), 5e5, style, scaling))
        outs.append((out, kc, vc))
    return outs


def _counting_into_cache(monkeypatch, module) -> list[bool]:
    """Counts the calls of `module`'s rope.into_cache: True where it rotated and wrote, False where
    it did not take the operands (the ops then do)."""
    calls, into = [], module.into_cache

    def counted(*args):
        rotated = into(*args)
        calls.append(rotated is not None)
        return rotated

    monkeypatch.setattr(module.rope, "into_cache", counted)
    return calls


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cached_attention_rotates_q_and_k_with_ropes_bits(dtype, style, isa, monkeypatch):
    """rope= against ops.rope on q and k before the call, host positions and positions gathered on
    the device, a step large enough for several threads, on every instruction set and 1 and 3
    threads: the same output and the same caches; on the native backend (fp32, bf16) the rotation
    and the write are one call, and a step made by hand takes the ops one by one with the same bits."""
    from lockstep.backends.native import build
    from lockstep.backends.native import rope as native_rope

    calls = _counting_into_cache(monkeypatch, native_rope)
    cases = ((None, False), (16, False), (None, True))
    for name, threads, (below, large) in itertools.product(build.supported_isas(), (1, 3), cases):
        isa(name)
        torch.set_num_threads(threads)
        fused, unfused, by_hand = _rotated_three_ways(dtype, style, below, large)
        for a, b, c_ in zip(fused, unfused, by_hand):
            assert torch.equal(a, b) and torch.equal(c_, b), (name, threads, below)
    assert sum(calls) == (0 if dtype == torch.float16 else 2 * len(cases) * len(build.supported_isas()))


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cached_attention_rotates_q_and_k_in_one_triton_launch_with_ropes_bits(dtype, style, monkeypatch):
    """The same on the Triton backend (its interpreter here), host positions and positions gathered on
    the device: the fused launch gives the output and caches of ops.rope and the write, every dtype."""
    from lockstep.backends.triton import rope as triton_rope

    calls = _counting_into_cache(monkeypatch, triton_rope)
    with lockstep.use_backend("triton"):
        for below in (None, 16):
            fused, unfused, by_hand = _rotated_three_ways(dtype, style, below, False)
            for a, b, c_ in zip(fused, unfused, by_hand):
                assert torch.equal(a, b) and torch.equal(c_, b), below
    assert calls == [True, True]


def test_the_rotation_and_cache_write_refuse_a_slot_outside_the_cache_and_write_nothing():
    from lockstep.backends.native.rope import into_cache
    from lockstep.rotary import Positions

    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match=r"^ls_rope_kv refused q \(2, 4, 16\), k \(2, 2, 16\) torch.float32 into a "
                                           r"cache \(2, 4, 2, 16\) at slots \[3, 8\]$"):
        into_cache(q, k, v, k_cache, v_cache, torch.tensor([3, 8]), Positions.read(torch.tensor([0, 1])), 1e4,
                   "neox", None)
    assert not k_cache.any() and not v_cache.any()


def test_cached_attention_names_a_rope_that_is_not_a_rotation():
    step, positions, (k_cache, v_cache), q, k, v = _step_with_cache(torch.float32)
    with pytest.raises(TypeError, match=r"^rope: expected a lockstep.rotary.Rotation or None, got tuple$"):
        ops.cached_attention(q, k, v, k_cache, v_cache, step, rope=(positions, 1e4))
