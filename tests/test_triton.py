"""The Triton backend through the same invariance sweeps and accuracy contract as the portable one.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by the backend's loader
before triton is imported), with small shapes. On a CUDA machine the same tests run compiled."""

from dataclasses import replace

import pytest
import torch

import triton  # noqa: E402,F401  (a test dependency: the kernels must be tested, not skipped)

import lockstep  # noqa: E402
from lockstep import ops  # noqa: E402
from lockstep.harness.attention_check import AttnSizes, check_attention  # noqa: E402
from lockstep.harness.check import check_op  # noqa: E402
from lockstep.harness.masked_attention_check import MaskedSizes, check_masked_attention  # noqa: E402
from lockstep.harness.specs import Sizes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = Sizes(hidden=96, out_features=40, heads=2, head_dim=16, ffn=64, vocab=1100, lm_hidden=32, embed_vocab=20,
              pool=70)      # > every Triton tile (GEMM 32/64 rows, 64-row partial sums); small for the interpreter
# The LM head ops' cost grows with the vocabulary and needs only to span more than one 128-row
# vocabulary chunk of the interpreter (selected_logprobs.VOCAB_CHUNK), the last one short;
# log_softmax and cross_entropy keep SMALL's 1100 columns, more than their 1024-lane row steps.
LM_HEAD = replace(SMALL, vocab=200)
# Ops whose kernels run one program per row (rope: per token), with no row tiles to cross: 24 rows
# run every sweep that 70 run (the batch of 133 runs at neither), in fewer programs for the interpreter.
ROWWISE = replace(SMALL, pool=24)
OPS = ["linear", "rms_norm", "rope", "silu_mul", "gelu_mul", "embedding", "log_softmax", "selected_logprobs", "vocab_logprobs",
       "cross_entropy"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_triton_op_contract(op, dtype):
    sizes = LM_HEAD if op in ("selected_logprobs", "vocab_logprobs") else ROWWISE if op in ("rope", "log_softmax",
                                                                                            "cross_entropy") else SMALL
    report = check_op(op, dtype, backend="triton", sizes=sizes, device=DEVICE)
    failures = [f"{s.sweep}: {s.detail} ({s.max_diff:.3e})" for s in report.sweeps if not s.passed]
    assert not failures, failures
    a = report.accuracy
    assert a.forward_excess <= 0 and (a.gradient_excess is None or a.gradient_excess <= 0), a
    assert a.relative_ok, a


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_attention_contract(dtype):
    # Paged decode of the last 8 tokens: the 70-token sequence's cross the cache block and the key
    # block at 64, the 37-token one's the cache block at 32.
    sizes = AttnSizes(lens=(37, 1, 70), q_heads=4, kv_heads=2, head_dim=16, chunks=(7, 16), decode=8)
    report = check_attention(dtype, backend="triton", sizes=sizes, device=DEVICE)
    failures = [f"{s.sweep}: {s.detail} ({s.max_diff:.3e})" for s in report.sweeps if not s.passed]
    assert not failures, failures
    a = report.accuracy
    assert a.forward_excess <= 0 and a.gradient_excess <= 0 and a.relative_ok, a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_masked_attention_contract(dtype):
    """Every masked_attention sweep bitwise (padding on either side, alone, reversed, next to NaN/Inf,
    decode of the last token) and its accuracy; the 66-token sequence crosses the 64-key block."""
    from _contract_checks import assert_attention_report

    sizes = MaskedSizes(lens=(9, 1, 66), q_heads=2, kv_heads=1, head_dim=16)
    report = check_masked_attention(dtype, backend="triton", sizes=sizes, device=DEVICE)
    assert report.backend == "triton"
    assert_attention_report(report, {"left padding", "more padding", "decode (last token alone)"})


def test_triton_masked_attention_under_a_mask_with_holes():
    """A mask with holes, bidirectional spans and queries that see nothing: each query alone (its
    mask row, all keys) gives its row's bits, and so do the same tokens after 70 keys and queries
    that nobody sees, forward and backward (dq, dk, dv on the real tokens)."""
    gen = torch.Generator().manual_seed(4)
    q, do = (torch.randn(2, 2, 20, 16, generator=gen).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(2, 1, 20, 16, generator=gen).to(DEVICE) for _ in range(2))
    visible = (torch.rand(2, 20, 20, generator=gen) < 0.6).to(DEVICE)
    visible[0, 3] = False                                   # sees no key: zeros, and no gradient
    visible[1, :, 12:] = True                               # a bidirectional span

    def run(q, k, v, visible, pad):
        q, k, v, do_ = (torch.nn.functional.pad(t, (0, 0, pad, 0), value=float("nan") if t is not do else 0.0)
                        for t in (q, k, v, do))
        visible = torch.nn.functional.pad(visible, (pad, 0, pad, 0), value=False)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with lockstep.use_backend("triton"):
            out, lse = ops.masked_attention(q, k, v, visible)
            out.backward(do_)
        return [t[:, :, pad:] for t in (out.detach(), q.grad, k.grad, v.grad)] + [lse[:, :, pad:]]

    ref = run(q, k, v, visible, 0)
    assert torch.equal(ref[0][0, :, 3], torch.zeros_like(ref[0][0, :, 3])) and torch.isneginf(ref[4][0, :, 3]).all()
    shifted = run(q, k, v, visible, 70)
    for name, a, b in zip(["out", "dq", "dk", "dv", "lse"], ref, shifted):
        assert torch.equal(a, b), name
    with lockstep.use_backend("triton"):
        for t in (0, 5, 13, 19):
            one, _ = ops.masked_attention(q[:, :, t:t + 1], k, v, visible[:, t:t + 1])
            assert torch.equal(one[:, :, 0], ref[0][:, :, t]), t


def test_triton_masked_attention_refuses_an_entry_past_32_bit_offsets():
    q, k = torch.zeros(1, 1, 1 << 16, 8), torch.zeros(1, 1, 1 << 15, 8)
    visible = torch.ones(1, 1, 1, dtype=torch.bool).expand(1, 1 << 16, 1 << 15)     # 2**31 elements, no memory
    with lockstep.use_backend("triton"), pytest.raises(ValueError, match=r"^visible: expected fewer than 2\*\*31 "
                                                                          r"elements per batch entry .* got 2147483648$"):
        ops.masked_attention(q, k, k, visible)


def test_triton_attention_window_and_head_dim_80():
    # Paged decode of the last 28 tokens: they cross the key block at 64, the cache blocks at 64 and
    # 80, and from position 83 the window leaves the first key block behind.
    sizes = AttnSizes(lens=(90, 3), q_heads=2, kv_heads=1, head_dim=80, window=20, chunks=(1, 7), decode=28)
    report = check_attention(torch.float32, backend="triton", sizes=sizes, device=DEVICE)
    assert report.invariant, [s for s in report.sweeps if not s.passed]
    assert report.accuracy.passed, report.accuracy


@pytest.mark.parametrize("block_q, warps", [(16, 4), (32, 4), (64, 4), (128, 8)])
def test_triton_attention_forward_at_every_query_tile(block_q, warps):
    """FWD_CONFIGS picks BLOCK_Q per GPU for speed: at any tile a sequence's rows are the same alone
    and batched, and a one-query decode step equals its prefill row. Under the interpreter, whose
    dot sums in one fixed order, the tile changes no bit at all (a key block a row cannot see is an
    exact no-op); on a GPU the MMA instruction follows the tile (docs/gpu.md)."""
    from lockstep.backends.triton.attention import AttentionConfig, _forward

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(79, h, 16, generator=g).to(DEVICE, torch.bfloat16) for h in (2, 1, 1))

    def run(q, k, v, cu_q, cu_k, cfg):
        return _forward(q, k, v, cu_q, cu_k, None, None, 0.25, True, None, False, cfg)[0]

    cfg = AttentionConfig(block_q, warps)
    both = run(q, k, v, [0, 70, 79], [0, 70, 79], cfg)
    assert torch.equal(both[:70], run(q[:70], k[:70], v[:70], [0, 70], [0, 70], cfg))
    decode = run(torch.stack([q[69], q[78]]), k, v, [0, 1, 2], [0, 70, 79], cfg)
    assert torch.equal(decode, torch.stack([both[69], both[78]]))
    if DEVICE == "cpu":
        assert torch.equal(both, run(q, k, v, [0, 70, 79], [0, 70, 79], AttentionConfig(16)))


def test_fp32_attention_keeps_the_default_query_tile_where_16_bit_takes_a_wider_one(monkeypatch):
    """ADR 0030: sm_90's 64 query rows were measured in bf16; fp32's tiles spill there, so fp32
    keeps 16 rows on every GPU."""
    from lockstep.backends.triton import attention

    monkeypatch.setattr(attention, "gpu_capability", lambda: 90)
    assert [attention.fwd_config(d).block_q for d in DTYPES] == [16, 64, 64]
    assert [attention.bwd_block_q(d) for d in DTYPES] == [16, 64, 64]
    monkeypatch.setattr(attention, "gpu_capability", lambda: 80)
    assert [attention.fwd_config(d).block_q for d in DTYPES] == [16, 16, 16]


@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's interpreter only")
def test_the_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """docs/adr/0029: inside a launch, a nested @triton.jit call does not patch triton.language
    again. The bits are those of the interpreter's own patching at every call, and the launch still
    hands the language back unpatched."""
    import triton.language as tl
    from triton.runtime import interpreter

    from lockstep.backends.triton.attention import _forward

    once = interpreter._patch_lang
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(70, h, 16, generator=g).to(torch.bfloat16) for h in (2, 1, 1))

    def run():
        return _forward(q, k, v, [0, 70], [0, 70], None, None, 0.25, True, None, False)[0]

    ours = run()
    if hasattr(interpreter, "_LangPatchScope"):        # interpreters that undo a launch's patch
        assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)
    calls = []
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn) or once.original(fn))
    assert torch.equal(ours, run())
    assert len(calls) > 10                             # the nested calls that `once` skips


@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's interpreter only")
def test_the_interpreter_keeps_each_dtypes_numpy_dtype(monkeypatch):
    """The interpreter's dtype lookup answers from a table kept across calls, with its own answers:
    for every Triton dtype, a block of it, and pointers (which do not hash); and a kernel gives the
    bits of the lookup that builds its table at every call."""
    import triton.language as tl
    from triton.runtime import interpreter

    from lockstep.backends.triton.attention import _forward

    cached = interpreter._get_np_dtype
    asked = [tl.float32, tl.bfloat16, tl.float16, tl.int1, tl.int32, tl.int64, tl.uint16,
             tl.block_type(tl.bfloat16, [4]), tl.pointer_type(tl.float32), tl.block_type(tl.pointer_type(tl.int8), [2])]
    assert [cached(t) for t in asked] == [cached.original(t) for t in asked]
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(20, h, 16, generator=g).to(torch.bfloat16) for h in (2, 1, 1))
    ours = _forward(q, k, v, [0, 20], [0, 20], None, None, 0.25, True, None, False)[0]
    monkeypatch.setattr(interpreter, "_get_np_dtype", cached.original)
    assert torch.equal(ours, _forward(q, k, v, [0, 20], [0, 20], None, None, 0.25, True, None, False)[0])


def test_auto_picks_triton_only_for_cuda_tensors():
    from lockstep.registry import cpu_backend, resolve

    assert resolve("linear", torch.device("cpu")).__module__.startswith(f"lockstep.backends.{cpu_backend()}")
    with lockstep.use_backend("triton"):
        assert resolve("linear", torch.device("cpu")).__module__.startswith("lockstep.backends.triton")


def test_cli_check_backend_triton(capsys, monkeypatch):
    """`lockstep check --backend triton` runs the op's sweeps on the Triton kernels, at the test's
    sizes (the command's own are for a compiled GPU kernel, not the interpreter)."""
    from lockstep import cli, harness

    monkeypatch.setattr(harness, "check_op", lambda *a, **k: check_op(*a, **k, sizes=SMALL))
    assert cli.main(["check", "silu_mul", "--dtype", "fp32", "--backend", "triton"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out


# --- GPU only ----------------------------------------------------------------------------------
def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return len(kernel.cache.get(torch.cuda.current_device(), {}))
    return sum(len(entry[0]) for entry in caches.values())


class _LaunchCounter:
    def __init__(self):
        self.names: dict[str, int] = {}

    def __call__(self, metadata):
        if not isinstance(metadata, dict) and callable(getattr(metadata, "get", None)):
            metadata = metadata.get()        # Triton 3.6 passes a LazyDict, whose get() resolves it
        name = getattr(metadata, "name", None) or metadata.get("name", "?")
        self.names[name] = self.names.get(name, 0) + 1

    def __enter__(self):
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "launch_enter_hook"):
            self._owner, self._attr = knobs.runtime, "launch_enter_hook"
        else:
            from triton.compiler import CompiledKernel
            self._owner, self._attr = CompiledKernel, "launch_enter_hook"
        self._old = getattr(self._owner, self._attr)
        setattr(self._owner, self._attr, self)
        return self

    def __exit__(self, *exc):
        setattr(self._owner, self._attr, self._old)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_row_counts_add_no_compiled_variant(dtype):
    """After the first row count has compiled each kernel once per signature (dW's fp32 output is
    its own signature), the sweep over rows {3, 16, 17, 100, 1024} compiles nothing new, and every
    kernel was launched."""
    from lockstep.backends.triton import gemm, log_softmax, rms_norm

    kernels = (gemm.gemm_kernel, rms_norm.rms_norm_fwd_kernel, rms_norm.rms_norm_bwd_kernel,
               log_softmax.log_softmax_fwd_kernel, log_softmax.log_softmax_bwd_kernel)
    k, n = 512, 384
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    norm_w = torch.ones(k, device="cuda", dtype=dtype)

    def step(rows):
        x = torch.randn(rows, k, device="cuda", dtype=dtype, requires_grad=True)
        ops.log_softmax(ops.linear(ops.rms_norm(x, norm_w), w)).sum().backward()

    with lockstep.use_backend("triton"), _LaunchCounter() as launches:
        step(1)
        torch.cuda.synchronize()
        first = [_compiled_variants(kernel) for kernel in kernels]
        for rows in (3, 16, 17, 100, 1024):
            step(rows)
        torch.cuda.synchronize()
    assert all(c >= 1 for c in first), first
    assert [_compiled_variants(kernel) for kernel in kernels] == first
    assert sum(launches.names.values()) >= 6 * len(kernels), launches.names


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_triton_contract_on_gpu_at_default_sizes(op):
    report = check_op(op, torch.bfloat16, backend="triton", device="cuda")
    assert report.passed, [s for s in report.sweeps if not s.passed]


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3_text"])
def test_moe_and_gemma_models_on_triton_match_portable_invariance(family):
    """The new families run on the Triton backend (interpreter here): logprobs are bitwise the same
    alone and packed, and within the contract's chain tolerance of the portable backend."""
    from lockstep import contract
    from lockstep.model import ModelConfig, Transformer, logprobs

    model = Transformer.from_config(ModelConfig.tiny(family, vocab_size=128, hidden_size=32, intermediate_size=64,
                                                     num_layers=2), seed=0)
    seqs = [torch.arange(3, 15), torch.arange(20, 31)]
    with torch.no_grad(), lockstep.use_backend("portable"):
        portable = logprobs(model, seqs)
    model.to(DEVICE)
    with torch.no_grad(), lockstep.use_backend("triton"):
        packed = [lp.cpu() for lp in logprobs(model, seqs)]
        alone = [logprobs(model, [s])[0].cpu() for s in seqs]
    assert all(torch.equal(a, b) for a, b in zip(alone, packed))
    worst = max(float((a - b).abs().max()) for a, b in zip(packed, portable))
    assert worst <= contract.chain_tolerance(torch.float32), worst
