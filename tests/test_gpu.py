"""The assembled pieces on a CUDA device: the verify gate, the trainer and the mode with a transformers
model, each on the Triton backend (which `auto` picks for CUDA tensors).

Every test here carries the gpu marker: on a machine without CUDA, conftest deselects them and says
how many. The op-level contract on CUDA lives in test_triton.py, which runs compiled there."""

import pytest
import torch

import lockstep
from lockstep.tools import verify
from lockstep.model import ModelConfig, Transformer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_verify_gate_is_exact_on_cuda(family, dtype):
    """Engine logprobs == trainer logprobs, bitwise, under every engine setting of the gate, and
    input-embedding gradients alone == batched."""
    def make(dt):
        return Transformer.from_config(ModelConfig.tiny(family), seed=0, dtype=dt).to("cuda")

    report = verify.run(make, [dtype], max_new_tokens=8, with_eager=False, log=lambda line: None)
    failed = [r for r in report.rows if not r["exact"]]
    assert report.passed and not failed, (failed, report.backward_chain)
    assert all(r["tokens"] > 0 for r in report.rows)


def test_trainer_window_gradients_do_not_depend_on_the_micro_batches_on_cuda():
    from test_train import _trainer          # test_train.py's trainer, on the GPU

    a, b = _trainer(accum=2, device="cuda"), _trainer(accum=1, micro_batch_tokens=1000, device="cuda")
    window = a.window()
    b.window()
    assert a.accumulate(window) == b.accumulate(window)
    assert all(g.is_cuda for g in a.grads.values())
    for name in a.grads:
        assert torch.equal(a.grads[name], b.grads[name]), name
    ra, rb = a.step(window), b.step(window)
    assert (ra["loss"], ra["grad_norm"]) == (rb["loss"], rb["grad_norm"])
    assert a.params_digest() == b.params_digest()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_mode_makes_a_transformers_model_invariant_on_cuda(family):
    """Alone vs right- and left-padded batches, and generate with its KV cache vs one forward, on
    CUDA dispatch keys. Stock cuBLAS may or may not differ at this size, so only lockstep's side is
    asserted."""
    from test_mode import _hf_model, _proof

    model = _hf_model(family, torch.bfloat16).to("cuda")
    with torch.no_grad(), lockstep.batch_invariant():
        assert _proof(model) == {"right": True, "left": True, "generate": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_mode_on_cuda_runs_the_triton_kernels_and_gives_their_ops_bits(dtype):
    """Under the mode, CUDA tensors take the Triton route (docs/adr/0039): a linear layer, log_softmax,
    RMSNorm and SDPA (whichever of its CUDA forms torch picks, causal with GQA and under a padding
    mask, forward and backward) launch the Triton backend's kernels, give the bits of its ops, and
    a row alone gives its bits in the batch."""
    from test_triton import _LaunchCounter
    from lockstep import ops

    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to("cuda", dtype)

    x, w, nw = randn(37, 256), randn(192, 256, scale=1 / 16), 1 + randn(256, scale=0.1)
    q, do, k, v = randn(2, 4, 70, 64), randn(2, 4, 70, 64), randn(2, 2, 70, 64), randn(2, 2, 70, 64)
    visible = torch.ones(2, 70, 70, dtype=torch.bool, device="cuda").tril()
    visible[1, :, :9] = False                               # left padding
    visible[1, :9] = False
    sdpa = torch.nn.functional.scaled_dot_product_attention

    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)      # as a model repeats its kv heads

    def attend(q, k, v, causal):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = sdpa(q, k, v, is_causal=True, enable_gqa=True) if causal else sdpa(q, k, v, attn_mask=visible[:, None])
        out.backward(do)
        return [out, q.grad, k.grad, v.grad]

    with lockstep.batch_invariant(), _LaunchCounter() as launches:
        y = torch.nn.functional.linear(x, w)
        one = torch.nn.functional.linear(x[5:6], w)
        lsm = torch.log_softmax(y, -1)
        norm, _ = torch.ops.aten._fused_rms_norm(x, [256], nw, 1e-6)
        causal, padded = attend(q, k, v, True), attend(q, kk, vv, False)
    torch.cuda.synchronize()
    with lockstep.use_backend("triton"):
        assert torch.equal(y, ops.linear(x, w)) and torch.equal(one[0], y[5])
        assert torch.equal(lsm, ops.log_softmax(y))
        assert torch.equal(norm, ops.rms_norm(x, nw, 1e-6))
        for got, keys, values, vis in ((causal, k, v, torch.ones_like(visible).tril()), (padded, kk, vv, visible)):
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, keys, values))
            out, _ = ops.masked_attention(qs, ks, vs, vis)
            out.backward(do)
            assert torch.equal(got[0], out)
            assert all(torch.equal(a, b) for a, b in zip(got[1:], (qs.grad, ks.grad, vs.grad)))
    for kernel in ("gemm_kernel", "log_softmax_fwd_kernel", "rms_norm_fwd_kernel", "attn_masked_fwd_kernel",
                   "attn_masked_bwd_dq_kernel", "attn_masked_bwd_dkdv_kernel"):
        assert launches.names.get(kernel, 0) > 0, (kernel, launches.names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masked_attention_contract_on_cuda(dtype):
    """ops.masked_attention on CUDA tensors (`auto` runs the Triton kernels there): every padding and
    decode sweep bitwise, accuracy against float64 and eager SDPA."""
    from _contract_checks import assert_attention_report
    from lockstep.harness.masked_attention_check import check_masked_attention

    report = check_masked_attention(dtype, device="cuda")
    assert report.backend == "triton"
    from lockstep.registry import resolve
    assert resolve("masked_attention", torch.device("cuda")).__module__ == "lockstep.backends.triton.masked_attention"
    assert_attention_report(report, {"left padding", "more padding", "decode (last token alone)"})


def test_rotary_tables_on_cuda_are_the_cpus_bit_for_bit():
    """rotary.rope_cos_sin builds a GPU's tables on the CPU and copies them (ADR 0021): the CPU's
    bits, also under inference mode and on a reused result; and exact_math.cos_sin_float64 run on the
    GPU itself gives the CPU's bits too (IEEE operations, each its own kernel)."""
    from lockstep import rotary
    from lockstep.numerics.exact_math import cos_sin_float64

    positions = torch.arange(0, 1 << 20, 97)
    for head_dim, theta, scaling in ((128, 1_000_000.0, None), (128, 500_000.0, rotary.Llama3RopeScaling())):
        for dtype in (torch.float32, torch.bfloat16):
            cpu = rotary.rope_cos_sin(positions, head_dim, theta, scaling, dtype)
            on_gpu = positions.cuda()
            with torch.inference_mode():
                first = rotary.rope_cos_sin(on_gpu, head_dim, theta, scaling, dtype)
            again = rotary.rope_cos_sin(on_gpu, head_dim, theta, scaling, dtype)
            for c, f, a in zip(cpu, first, again):
                assert f.is_cuda and a is f and torch.equal(c, f.cpu()), (head_dim, theta, scaling, dtype)
    angles = positions[:, None].double() * rotary.rope_inv_freq(128, 1e6)
    for c, g in zip(cos_sin_float64(angles), cos_sin_float64(angles.cuda())):
        assert torch.equal(c, g.cpu())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_decode_replayed_from_cuda_graphs_gives_the_eager_bits(family):
    """Engine(cuda_graphs=True): each bucket's decode forward captured once and replayed gives the
    tokens and logprobs of the same engine run eagerly, with requests finishing at different steps
    (so buckets shrink) and a mix of greedy and seeded sampling."""
    from lockstep import Engine, SamplingParams

    model = Transformer.from_config(ModelConfig.tiny(family), seed=0, dtype=torch.bfloat16).to("cuda")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15]]
    params = [SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(len(prompts))]
    eager = Engine(model, max_num_seqs=4).generate(prompts, params)
    engine = Engine(model, max_num_seqs=4, cuda_graphs=True)
    replayed = engine.generate(prompts, params)
    assert sorted(engine.runner.graphs) == [1, 2, 4], sorted(engine.runner.graphs)
    assert [(o.token_ids, o.logprobs) for o in replayed] == [(o.token_ids, o.logprobs) for o in eager]
