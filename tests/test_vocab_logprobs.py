import pytest
import torch

import lockstep
from lockstep import ops
from lockstep.harness.check import check_large

from _contract_checks import DTYPES, assert_op_contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocab_logprobs_contract(dtype):
    assert_op_contract("vocab_logprobs", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vocab_logprobs_152k_vocab_one_row_vs_many(dtype):
    result = check_large("vocab_logprobs", dtype)
    assert result.passed and result.compared > 0, result


def _vocab_chunk(backend: str) -> int:
    """The vocabulary rows per chunk of `backend`'s online log-sum-exp (the Triton backend's is
    smaller under its interpreter)."""
    if backend == "triton":
        from lockstep.backends.triton.selected_logprobs import VOCAB_CHUNK
    else:
        from lockstep.backends.portable.selected_logprobs import VOCAB_CHUNK
    return VOCAB_CHUNK


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["portable", "native", "triton"])
def test_every_entry_has_the_bits_selected_logprobs_gives_it(backend, dtype, temperature):
    """What a sampler reports (an entry of vocab_logprobs) is what the trainer recomputes
    (selected_logprobs), bit for bit, whichever token was drawn."""
    gen = torch.Generator().manual_seed(0)
    chunk = _vocab_chunk(backend)
    vocab = chunk + 300                             # two vocabulary chunks, the second short
    hidden = torch.randn(3, 32, generator=gen).to(dtype)
    weight = (torch.randn(vocab, 32, generator=gen) / 6).to(dtype)
    with lockstep.use_backend(backend):
        full = ops.vocab_logprobs(hidden, weight, temperature=temperature)
        for t in (0, 17, chunk - 1, chunk, vocab - 1):
            targets = torch.full((3,), t)
            assert torch.equal(full[:, t], ops.selected_logprobs(hidden, weight, targets, temperature=temperature))
    assert full.dtype == torch.float32 and full.shape == (3, vocab)
    torch.testing.assert_close(full.exp().sum(-1), torch.ones(3), atol=1e-4, rtol=0)


def test_vocab_logprobs_has_no_gradient_and_checks_its_arguments():
    h, w = torch.randn(2, 8, requires_grad=True), torch.randn(10, 8)
    assert not ops.vocab_logprobs(h, w).requires_grad
    with pytest.raises(ValueError, match="temperature: expected a positive finite number"):
        ops.vocab_logprobs(h, w, temperature=0.0)
    with pytest.raises(ValueError, match=r"weight: expected shape \[V, 8\]"):
        ops.vocab_logprobs(h, torch.randn(10, 9))


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_batched_log_sum_exp_of_few_rows_has_the_bits_of_the_chunk_loop(dtype, kernels, monkeypatch):
    """online_lse folds the chunks of a few rows (decode) all at once on PyTorch's kernels, and on
    the native kernels takes their logits from one GEMM and folds them in one call (lse_fold's
    width): the same operations on the same values as the loop over chunks (on the native kernels,
    their fused lse_fold), so the same bits; NaN and Inf rows included, with a cap and a
    temperature, and a vocabulary whose last chunk is short."""
    from lockstep.backends.native.cpu import KERNELS
    from lockstep.backends.portable import selected_logprobs as portable

    assert KERNELS.lse_fold is not None
    kernels = {"torch": None, "native": KERNELS}[kernels]
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(16, 64, generator=gen) * 3).to(dtype)
    h[1], h[3, 0] = float("nan"), float("inf")
    w = torch.randn(3 * portable.VOCAB_CHUNK + 77, 64, generator=gen).to(dtype)
    for temperature, cap in ((1.0, None), (0.7, None), (0.7, 5.0)):
        monkeypatch.setattr(portable, "BATCHED_LSE_ELEMENTS", 0)
        loop = portable.online_lse(h, w, temperature, cap=cap, kernels=kernels)
        monkeypatch.setattr(portable, "BATCHED_LSE_ELEMENTS", 1 << 40)
        batched = portable.online_lse(h, w, temperature, cap=cap, kernels=kernels)
        assert torch.equal(loop.isnan(), batched.isnan()) and loop.isnan()[1]
        assert torch.equal(loop[~loop.isnan()], batched[~batched.isnan()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_few_rows_logits_from_one_gemm_have_the_chunked_bits(dtype, monkeypatch):
    """On the native kernels a few rows' logits come from one GEMM over the whole vocabulary
    (whole_logits; its columns have the same bits at any width): each chunk's slice has the bits of
    the chunk's own GEMM, at K of 64, 1000 (panels that do not divide a chunk) and 4100 (K in
    blocks). vocab_logprobs and selected_logprobs then give the bits of the chunk by chunk
    computation, NaN and Inf rows, caps, temperatures and a short last chunk included. PyTorch's
    GEMMs never take that path."""
    from lockstep.backends.native.cpu import KERNELS
    from lockstep.backends.portable import selected_logprobs as portable

    gen = torch.Generator().manual_seed(3)
    h = (torch.randn(5, 64, generator=gen) * 3).to(dtype)
    h[1], h[3, 0] = float("nan"), float("inf")
    w = (torch.randn(3 * portable.VOCAB_CHUNK + 77, 64, generator=gen) / 4).to(dtype)
    targets = torch.tensor([0, 5, 4095, 4096, w.shape[0] - 1])
    assert portable.whole_logits(h, w, None) is None
    for k in (64, 1000, 4100):
        hk = h if k == 64 else torch.randn(5, k, generator=gen).to(dtype)
        wk = w if k == 64 else (torch.randn(2 * portable.VOCAB_CHUNK + 77, k, generator=gen) / 4).to(dtype)
        whole = portable.whole_logits(hk, wk, None, kernels=KERNELS)
        assert whole.shape == (5, wk.shape[0])
        ints = torch.int32 if whole.element_size() == 4 else torch.int16
        for start in range(0, wk.shape[0], portable.VOCAB_CHUNK):
            chunk, _ = portable._chunk_logits(hk, wk, start, torch.float32, None, KERNELS)
            assert torch.equal(whole[:, start:start + portable.VOCAB_CHUNK].view(ints), chunk.view(ints)), k
    real = portable.whole_logits
    for temperature, cap in ((1.0, None), (0.7, None), (0.7, 5.0)):
        runs = []
        for whole in (real, lambda *a, **k: None):
            monkeypatch.setattr(portable, "whole_logits", whole)
            with lockstep.use_backend("native"):
                runs.append((ops.vocab_logprobs(h, w, temperature=temperature, softcap=cap),
                             ops.selected_logprobs(h, w, targets, temperature=temperature, softcap=cap)))
        for one_call, chunked in zip(*runs):
            assert torch.equal(one_call.isnan(), chunked.isnan()) and one_call.isnan()[1].all()
            assert torch.equal(one_call[~one_call.isnan()], chunked[~chunked.isnan()]), (temperature, cap)
