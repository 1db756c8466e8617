"""The engine's step asks little of the host: a step's metadata is built and checked once, on the
host (paged_cache.build_step), and the forward reads nothing back from the device.

On a GPU each read of tensor data is a synchronization and each aten op a launch, so they are
counted here (lockstep.tools.host_work) at two depths of the same model: what a layer adds is the
difference. The native backend runs the model, as on a CPU it does by default."""

from __future__ import annotations

import pytest
import torch

from lockstep import ops
from lockstep.engine import Engine
from lockstep.model import ModelConfig, Transformer
from lockstep.paged_cache import CacheStep, build_step, step_size
from lockstep.registry import use_backend
from lockstep.sampling import SamplingParams
from lockstep.tools.host_work import HostWork

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe"]
# The most aten ops (not views, not bare allocations) one layer may add to a decode step: on a GPU
# each is a launch of about 5 us.
OPS_PER_LAYER = 12
READS_PER_STEP = 2
SAMPLING = [SamplingParams(max_new_tokens=8, temperature=0.0),
            SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=3),
            SamplingParams(max_new_tokens=8, temperature=0.7, min_p=0.05, repetition_penalty=1.3, seed=4, logprobs=3),
            SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)]


def _model(family: str, layers: int) -> Transformer:
    extra = {"layer_types": ("sliding_attention", "full_attention") * (layers // 2)} if family == "gemma3_text" else {}
    return Transformer.from_config(ModelConfig.tiny(family, num_layers=layers, **extra))


def _counted_steps(family: str, layers: int) -> tuple[HostWork, HostWork]:
    """(a decode step's work, a step that mixes a prefill chunk with decodes) on a model of `layers`."""
    engine = Engine(_model(family, layers), max_num_seqs=5, max_num_batched_tokens=12, block_size=4)
    for i, params in enumerate(SAMPLING):
        engine.add_request([1 + i, 7, 3, 9, 4, 2][: 3 + i], params)
    engine.step()
    engine.step()                           # every prompt in: the next steps decode 4 rows
    engine.step()                           # the first builds what a process builds once (rope's table)
    with HostWork() as decode:
        engine.step()
    engine.add_request(list(range(20, 40)), SamplingParams(max_new_tokens=2))
    with HostWork() as mixed:                # 4 decode rows and a chunk of the new prompt
        engine.step()
    return decode, mixed


@pytest.fixture(scope="module", params=FAMILIES)
def counted(request):
    with use_backend("native"):
        return request.param, {layers: _counted_steps(request.param, layers) for layers in (2, 4)}


def _sparse_moe_misses(request, family: str, reason: str) -> None:
    if family == "qwen3_moe":
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


def test_a_step_reads_the_device_at_most_twice_at_any_depth(counted, request):
    """The drawn tokens and their logprobs: nothing else of a step comes back to the host, in a
    decode step or one that mixes a prefill chunk in, whatever the number of layers."""
    family, work = counted
    _sparse_moe_misses(request, family, "a sparse MoE layer reads its experts' token counts to split the rows by expert")
    for kind in (0, 1):
        assert work[2][kind].reads == work[4][kind].reads, (family, kind)
        assert work[4][kind].total_reads <= READS_PER_STEP, (family, kind, work[4][kind].reads)


def test_a_layer_adds_at_most_twelve_aten_ops_to_a_decode_step(counted, request):
    family, work = counted
    _sparse_moe_misses(request, family, "a sparse MoE layer runs its experts one by one, a few ops each")
    per_layer = (work[4][0].total_ops - work[2][0].total_ops) / 2
    assert per_layer <= OPS_PER_LAYER, (family, per_layer, work[4][0].ops - work[2][0].ops)


def test_a_dense_layer_on_the_native_backend_adds_no_aten_op_to_a_step(counted, request):
    """Every op of a dense layer is one of the backend's kernel calls: the residual adds go with
    their norms and the cache write with the rotation (ADR 0042)."""
    family, work = counted
    _sparse_moe_misses(request, family, "a sparse MoE layer routes, sorts and combines its rows in aten")
    assert work[4][0].ops == work[2][0].ops, (family, work[4][0].ops - work[2][0].ops, work[2][0].ops - work[4][0].ops)


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast-bf16"])
def test_a_step_built_by_hand_gives_the_bits_of_the_checked_host_copy(autocast):
    """forward_cached over a CacheStep made by hand (no host copy: the ops read and check its
    values) and over build_step's (nothing read back) give the same hidden states and caches, also
    under torch.autocast, where the fp32 cache stores the keys and is read in bf16."""
    model = _model("qwen3", 2)
    spans = [([3, 1], 0, 6), ([0], 2, 3)]
    tokens = [5, 9, 2, 7, 7, 1, 4]
    results = []
    for by_hand in (False, True):
        cache = model.allocate_kv_cache(4, 4)
        for k, v in zip(cache.k, cache.v):
            k.zero_(), v.zero_()
        step, positions = build_step(spans, 4, tokens=tokens, vocab_size=model.config.vocab_size)
        ids = step.host.input_ids
        if by_hand:
            step = CacheStep(step.cu_seqlens_q.clone(), step.seq_lens.clone(), step.block_table.clone(),
                             step.slot_mapping.clone())
            ids, positions = ids.clone(), positions.clone()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model.forward_cached(ids, positions, step, cache)
        results.append((hidden, torch.stack(cache.k), torch.stack(cache.v)))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_a_decode_step_built_by_hand_gives_the_bits_of_the_built_one(backend):
    """A decode step (one token per sequence) from build_step runs each backend's trusted path (on
    Triton: the step's device tensors read in place, TablePositions for rope); by hand, the checked
    one. Both give the same hidden states and caches."""
    model = _model("qwen3", 2)
    spans, tokens = [([3, 1], 5, 6), ([0], 2, 3), ([2], 0, 1)], [5, 9, 2]
    results = []
    with use_backend(backend):
        for by_hand in (False, True):
            cache = model.allocate_kv_cache(4, 4)
            for k, v in zip(cache.k, cache.v):
                k.fill_(0.5), v.fill_(-0.25)
            step, positions = build_step(spans, 4, tokens=tokens, vocab_size=model.config.vocab_size, width=3,
                                         positions_below=64)
            ids = step.host.input_ids
            if by_hand:
                step = CacheStep(step.cu_seqlens_q.clone(), step.seq_lens.clone(), step.block_table.clone(),
                                 step.slot_mapping.clone())
                ids, positions = ids.clone(), positions.clone()
            with torch.no_grad():
                hidden = model.forward_cached(ids, positions, step, cache)
            results.append((hidden, torch.stack(cache.k), torch.stack(cache.v)))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("spans, tokens, message", [
    ([([0], 0, 2), ([0], 0, 2)], None, "^spans: two new tokens would be written to the same cache slot$"),
    ([([0, -1], 0, 6)], None, r"^spans: sequence 0 has a block id that is not an int in \[0, 2\^31\): \[0, -1\]$"),
    ([([0, 2 ** 31], 0, 6)], None, r"^spans: sequence 0 has a block id that is not an int in \[0, 2\^31\): "
                                   r"\[0, 2147483648\]$"),
    ([([0], 2, 2)], None, r"^spans: sequence 0 asks for positions \[2, 2\) with 1 blocks of 4$"),
    ([([0], 0, 2)], [1], r"^tokens: expected 2 ids \(one per new token\), got 1$"),
    ([([0], 0, 2)], [1, 512], r"^tokens: expected ids in \[0, 512\), got \[512\]$"),
    ([([0], 0, 2)], [1, True], r"^tokens: expected ids in \[0, 512\), got \[True\]$"),
])
def test_build_step_refuses_bad_metadata_by_name(spans, tokens, message):
    with pytest.raises(ValueError, match=message):
        build_step(spans, 4, tokens=tokens, vocab_size=512)
    with pytest.raises(ValueError, match=r"^vocab_size: expected a positive int with the tokens, got None$"):
        build_step([([0], 0, 2)], 4, tokens=[1, 2])


def test_a_built_step_is_checked_against_the_cache_it_meets():
    """The host copy stands for the step's values, so what it cannot know (the cache it is run
    with, the new tokens' rows) is checked by name where the two meet."""
    step, _ = build_step([([5], 0, 3)], 4)
    q, kv = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    small, other_blocks = torch.zeros(4, 4, 2, 8), torch.zeros(8, 8, 2, 8)
    for cache in (small, other_blocks):
        with pytest.raises(ValueError, match=r"^step: built for blocks of 4 up to block 5, the cache has"):
            ops.cached_attention(q, kv, kv, cache, cache.clone(), step)
    cache = torch.zeros(8, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^q: expected the step's 3 new tokens in q, k and v, got 2, 2$"):
        ops.cached_attention(q[:2], kv[:2], kv[:2], cache, cache.clone(), step)


def test_a_built_step_given_another_block_table_is_checked_by_reading_it():
    """The host copy stands only for the tensors build_step made: a step that holds another block
    table (dataclasses.replace) goes through the checked ops, which refuse a block outside the cache."""
    import dataclasses

    step, _ = build_step([([0, 1], 0, 5)], 4)
    bad = dataclasses.replace(step, block_table=torch.tensor([[0, 1 << 40]]))
    q, kv, cache = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8), torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^block_table: sequence 0 points at block 1099511627776, outside the "
                                         r"cache's 4 blocks$"):
        ops.cached_attention(q, kv, kv, cache, cache.clone(), bad)


def test_positions_derive_their_range_from_their_values():
    from lockstep.rotary import Positions

    p = Positions(torch.tensor([0, 1, 2]), (0, 1, 2))
    assert (p.low, p.high) == (0, 2) and torch.equal(p.host, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"^positions: expected a tuple of 3 values, one per position$"):
        Positions(torch.tensor([0, 1, 2]), (0, 1))
    with pytest.raises(TypeError, match=r"^positions: expected an int64 tensor \[T\] beside its values$"):
        Positions(torch.tensor([0, 1, 2], dtype=torch.int32), (0, 1, 2))


# The Triton backend's decode step (Triton's interpreter here, no GPU): each kernel launch is counted
# apart from the aten ops. A layer of the tiny Qwen3 launches q/k/v and gate/up as one grouped GEMM
# each, o_proj and down_proj each in the parts that tensor parallelism may shard (two here:
# tp_split, ADR 0007), the q and k norms, the two residual adds each with the norm after it, rope
# with the cache write, the attention and the activation (ADR 0042); around them only the sums of
# the split GEMMs run as aten ops.
TRITON_LAUNCHES_PER_LAYER = 13


def test_a_triton_decode_step_launches_the_layers_kernels_and_little_else():
    def step_work(layers: int) -> HostWork:
        engine = Engine(_model("qwen3", layers), max_num_seqs=2, block_size=4)
        for i, params in enumerate(SAMPLING[:2]):
            engine.add_request([1 + i, 7, 3], params)
        engine.step()
        engine.step()                       # the first decode builds rope's table, once a process
        with HostWork() as decode:
            engine.step()
        return decode

    with use_backend("triton"):
        one, two = step_work(1), step_work(2)
    assert two.total_reads <= READS_PER_STEP and one.reads == two.reads, two.reads
    assert two.total_launches - one.total_launches == TRITON_LAUNCHES_PER_LAYER, two.launches - one.launches
    assert {k: v for k, v in (two.launches - one.launches).items() if k != "gemm_kernel"} == {
        "gemm_group_kernel": 2, "rms_norm_fwd_kernel": 2, "add_rms_norm_fwd_kernel": 2, "rope_kv_kernel": 1,
        "attn_fwd_kernel": 1, "silu_mul_fwd_kernel": 1}, two.launches - one.launches
    # The attention's metadata moves to the device once a step (here in build_step's one transfer),
    # not once a layer.
    assert two.total_ops - one.total_ops <= 2, two.ops - one.ops


def test_triton_paged_attention_derives_a_steps_metadata_again_when_the_step_changes():
    """The metadata kept for a step's other layers is used only for the same tuples and the same,
    unchanged block table: a block table edited in place, or another step, is read afresh."""
    from lockstep.backends.triton.attention import paged_attention

    gen = torch.Generator().manual_seed(0)
    cache_k, cache_v = torch.randn(4, 4, 1, 8, generator=gen), torch.randn(4, 4, 1, 8, generator=gen)
    q = torch.randn(2, 2, 8, generator=gen)
    cu, lens = (0, 1, 2), (3, 5)
    table = torch.tensor([[0, 1], [2, 3]])
    run = lambda t, c=cu, n=lens: paged_attention(q, cache_k, cache_v, t, n, c, 0.5, True, None)  # noqa: E731
    first = run(table)
    table[0, 0] = 3                                      # in place: the same tensor, a new version
    assert torch.equal(run(table), run(table.clone())) and not torch.equal(run(table), first)
    assert torch.equal(run(table, n=(4, 5)), run(table.clone(), n=(4, 5)))


def test_decode_steps_of_a_bucket_run_on_its_buffer_padded_into_scratch_blocks(monkeypatch):
    """A decode step of 3 sequences runs as the bucket of 4: its step tensors are views of that
    bucket's one buffer at every step, and the padding row decodes into a scratch block past the
    engine's blocks. Prefill steps build their own tensors. The bits are those of the engine
    without static buffers (tests/test_engine.py) and stay finite with NaN in the scratch blocks."""
    model = _model("llama", 2)
    engine = Engine(model, max_num_seqs=5, block_size=4, num_blocks=12)
    decode = engine.runner.decode
    assert decode.buckets == [1, 2, 4, 5] and decode.scratch_blocks == 2 and decode.first_scratch == 12
    # The table is as wide as the longest sequence the 12 blocks of 4 can hold, rope's table as long.
    assert (decode.width, decode.positions_below) == (12, 48) and model.config.max_position_embeddings > 48
    assert engine.runner.cache.k[0].shape[0] == 14
    for t in engine.runner.cache.k + engine.runner.cache.v:
        t[12:].fill_(float("nan"))
    seen = []
    forward = model.forward_cached

    def recording(ids, positions, step, cache):
        seen.append((step.block_table.untyped_storage().data_ptr(), step.host.seq_lens, step.slot_mapping.tolist()))
        return forward(ids, positions, step, cache)

    monkeypatch.setattr(model, "forward_cached", recording)
    outs = engine.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], SamplingParams(max_new_tokens=4, temperature=0.0))
    decodes = [s for s in seen if len(s[1]) == 4]
    assert len(decodes) == 3 and len({ptr for ptr, _, _ in decodes}) == 1
    assert decode.flat(4, model.device).untyped_storage().data_ptr() == decodes[0][0]
    assert all(lens[3] == 1 and slots[3] == 12 * 4 for _, lens, slots in decodes)   # padding row 0 of block 12
    assert all(max(slots[:3]) < 12 * 4 for _, _, slots in decodes)
    plain = Engine(model, max_num_seqs=5, block_size=4, num_blocks=12, static_decode=False)
    monkeypatch.undo()
    want = plain.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert [(o.token_ids, o.logprobs) for o in outs] == [(o.token_ids, o.logprobs) for o in want]


def test_build_step_into_a_buffer_checks_its_size_and_width():
    step, _ = build_step([([0, 1], 0, 5)], 4, width=3, into=torch.empty(step_size(1, 5, 3, with_ids=False),
                                                                        dtype=torch.int64))
    assert step.block_table.tolist() == [[0, 1, 0]]
    cu32, lens32, table32 = step.host.indices32            # the kernels' int32 copies, in the same buffer
    assert [t.dtype for t in step.host.indices32] == [torch.int32] * 3
    assert (cu32.tolist(), lens32.tolist(), table32.tolist()) == ([0, 5], [5], [[0, 1, 0]])
    with pytest.raises(ValueError, match=r"^width: expected an int of at least 2 \(the most blocks of a sequence\), "
                                         r"got 1$"):
        build_step([([0, 1], 0, 5)], 4, width=1)
    with pytest.raises(ValueError, match=r"^into: expected a flat int64 tensor of 26 elements \(this step's layout\), "
                                         r"got \(20,\)$"):
        build_step([([0, 1], 0, 5)], 4, width=3, into=torch.empty(20, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^into: expected a tensor on meta \(device\), got one on cpu$"):
        build_step([([0, 1], 0, 5)], 4, "meta", width=3, into=torch.empty(26, dtype=torch.int64))


def test_build_step_aligns_every_view_to_16_bytes_at_any_batch_size():
    """Triton specializes a kernel on whether its pointers are 16-byte aligned, so views whose
    alignment followed the batch would compile a second attention binary for some batch sizes."""
    for b in range(1, 6):
        for new in (1, 3):
            spans = [([2 * i, 2 * i + 1], 4, 4 + new) for i in range(b)]
            buffer = torch.empty(step_size(b, b * new, 3), dtype=torch.int64)
            step, positions = build_step(spans, 4, width=3, tokens=[1] * (b * new), vocab_size=2, into=buffer)
            views = [step.cu_seqlens_q, step.seq_lens, step.block_table, step.slot_mapping, positions,
                     step.host.input_ids, *step.host.indices32]
            assert all(v.data_ptr() % 16 == 0 for v in views), (b, new, [v.data_ptr() % 16 for v in views])
            assert step.seq_lens.tolist() == [4 + new] * b
            assert step.host.indices32[1].tolist() == [4 + new] * b
            assert step.host.indices32[2].tolist() == [[2 * i, 2 * i + 1, 0] for i in range(b)]
            assert step.host.input_ids.tolist() == [1] * (b * new)


@pytest.mark.parametrize("backend", ["native", "portable"])
def test_table_positions_rotate_with_the_bits_of_host_positions(backend):
    """rope's angles gathered from the device table of every position below the bound are the
    host-built ones, bit for bit, here up to the edge of the bound."""
    from lockstep.rotary import TablePositions

    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    where = torch.tensor([0, 7, 4094, 4095, 31])
    with use_backend(backend):
        assert torch.equal(ops.rope(x, TablePositions(where, 4096), 500000.0), ops.rope(x, where, 500000.0))
    with pytest.raises(ValueError, match=r"^limit: expected an int in \[1, 2\^24 = 16777216\], got 0$"):
        TablePositions(where, 0)


def test_build_step_checks_the_bound_of_table_positions():
    with pytest.raises(ValueError, match=r"^positions_below: expected an int in \[1, 2\^24 = 16777216\], got True$"):
        build_step([([0, 1], 0, 5)], 4, positions_below=True)
    with pytest.raises(ValueError, match=r"^spans: sequence 0 reaches position 4, not below positions_below = 4$"):
        build_step([([0, 1], 0, 5)], 4, positions_below=4)


def test_a_decode_step_replays_from_its_buffer_as_a_captured_graph_would():
    """What a CUDA graph does, emulated on the Triton backend (the one CUDA runs): the forward's
    Python runs once, for one step (A), and later steps (B) only change the bucket's buffer. Run with
    A's objects (as captured: unremembered, after a first forward with A) over B's values, the
    forward must compute B's bits, hidden states and cache: nothing of A may stay in what it computes."""
    from lockstep.engine.model_runner import DecodeBuffers, unremembered

    model = _model("qwen3", 2)
    buffers = DecodeBuffers(4, 64, 4, 8)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    start = model.allocate_kv_cache(8 + buffers.scratch_blocks, 4)
    for t in start.k + start.v:
        t.copy_(torch.randn(t.shape, generator=gen))

    def built(spans, tokens, into=None):
        spans, tokens = buffers.padded(spans, tokens)
        return build_step(spans, 4, tokens=tokens, vocab_size=vocab, width=buffers.width, into=into,
                          positions_below=buffers.positions_below)[0]

    a = ([([0, 1], 4, 5), ([2], 1, 2), ([3], 0, 1)], [5, 9, 2])
    b = ([([0, 1], 6, 7), ([2], 3, 4), ([3, 4], 5, 6)], [7, 1, 8])
    with use_backend("triton"), torch.no_grad():
        cache = model.allocate_kv_cache(8 + buffers.scratch_blocks, 4)
        for t, s in zip(cache.k + cache.v, start.k + start.v):
            t.copy_(s)
        step = built(*b)
        want = model.forward_cached(step.host.input_ids, step.host.positions.tensor, step, cache)
        want_cache = torch.stack(cache.k + cache.v)

        for t, s in zip(cache.k + cache.v, start.k + start.v):
            t.copy_(s)
        flat = buffers.flat(4, torch.device("cpu"))
        step_a = built(*a, into=flat)
        model.forward_cached(step_a.host.input_ids, step_a.host.positions.tensor, step_a, cache)   # warm-up
        captured = unremembered(step_a)
        for t, s in zip(cache.k + cache.v, start.k + start.v):
            t.copy_(s)
        built(*b, into=flat)                                 # B's values in A's buffer
        got = model.forward_cached(captured.host.input_ids, captured.host.positions.tensor, captured, cache)
    assert torch.equal(got[:3], want[:3]) and torch.equal(torch.stack(cache.k + cache.v)[:, :8], want_cache[:, :8])


def test_capturing_a_decode_step_on_a_backend_that_reads_its_step_on_the_host_is_refused():
    """A CUDA graph replays only device work: attention that reads the step's metadata on the host
    (the native and portable backends) would replay the captured step's. The check comes before any
    capture, so a runner asked for graphs refuses it by name, here on CPU."""
    from lockstep.engine.model_runner import ModelRunner

    model = _model("qwen3", 2)
    runner = ModelRunner(model, num_blocks=8, block_size=4, max_num_seqs=2, max_len=16, cuda_graphs=True)
    step, _ = build_step([([0], 0, 1)], 4, tokens=[3], vocab_size=model.config.vocab_size,
                         width=runner.decode.width, positions_below=runner.decode.positions_below)
    with use_backend("native"), torch.no_grad(), pytest.raises(
            RuntimeError, match=r"^cuda_graphs: the decode step's attention runs on lockstep\.backends\.native\.\w+, "
                                r"which reads its step on the host; CUDA graphs need the Triton backend's"):
        runner._decode_forward(step, step.host.positions.tensor)
    assert runner.graphs == {}
