"""What lockstep runs on the native backend dispatches only exact ATen ops on floating-point data,
so that no reduction in PyTorch's order reaches its bits (docs/adr/0021)."""

from __future__ import annotations

import traceback

import torch

from lockstep import registry

from _native_helpers import DTYPES


# ATen ops whose value on floating-point tensors is exact (IEEE-rounded arithmetic, moves, selections,
# comparisons), so their bits cannot follow the thread count, the instruction set or the BLAS.
# scatter_add, and cumsum (the sampler's top-p), run serially in index order on the CPU. Two are exact
# only in some calls (`_exact_call`): index_put with accumulate (parallel on several threads, so its
# sums at a repeated index change from run to run) with unique indices, and add / sub / rsub with
# alpha 1 or -1 (the vector kernels fuse alpha into an FMA). Anything else (mm and the BLAS, sum,
# softmax, exp, tanh, pow with a general exponent, ...) reduces or rounds in an order of PyTorch's
# kernels and would make the native backend's bits the machine's. sqrt and rsqrt are not here: ATen
# sends them through MKL's vector math, which picks its code by the CPU's maker (on this AMD EPYC one
# fp32 torch.sqrt in five is an ulp off the IEEE root, and float64 rsqrt gives other bits on QEMU's
# Haswell than here; docs/adr/0021).
EXACT_ATEN_OPS = frozenset("""
    _local_scalar_dense _to_copy _unsafe_view abs alias amax amin argmax argmin as_strided cat ceil clamp
    clamp_ clamp_max clamp_min clone constant_pad_nd copy_ cummax cummin cumsum detach div div_ empty empty_like
    empty_strided eq expand fill fill_ flip floor frexp full full_like gather ge gt index index_copy index_copy_
    index_select isfinite isinf isnan le lift_fresh lt masked_fill masked_fill_ max maximum min
    minimum mul mul_ nan_to_num narrow ne neg neg_ new_empty new_empty_strided new_full new_ones new_zeros ones
    ones_like permute reciprocal reciprocal_ repeat round scalar_tensor scatter scatter_ scatter_add
    select select_backward sign slice slice_backward sort split split_with_sizes squeeze stack t topk
    transpose tril triu trunc unbind unsqueeze view where zero_ zeros zeros_like
""".split())


def _exact_call(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether one call of an op outside EXACT_ATEN_OPS is exact all the same (see above)."""
    if name in ("add", "add_", "sub", "sub_", "rsub"):
        return kwargs.get("alpha", 1) in (1, -1)
    if name in ("index_put", "index_put_"):
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        indices = [i for i in args[1] if i is not None]
        if not accumulate or any(i.dtype == torch.bool for i in indices):
            return True
        rows = torch.stack([i.reshape(-1) for i in torch.broadcast_tensors(*indices)], 1)
        return torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    return name == "pow" and args[1:2] in ((2,), (2.0,))          # x * x


class _AtenAudit(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each ATen op that touches a floating-point tensor and is not in EXACT_ATEN_OPS, with
    the lockstep frames that called it."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()
        self.inexact: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.is_floating_point() for t in tensors):
            name = func.overloadpacket.__name__
            self.seen.add(name)
            exact = name in EXACT_ATEN_OPS or _exact_call(name, args, kwargs or {})
            if not exact and str(func) not in self.inexact:
                frames = [f"{f.filename.rsplit('/src/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()
                          if "/src/lockstep/" in f.filename]
                # The harness draws each call's padding rows: the workload's input, not lockstep's arithmetic.
                if not (name in ("randn", "rand") and frames and frames[-1].startswith("lockstep/harness/")):
                    self.inexact[str(func)] = " < ".join(reversed(frames[-3:]))
        return out


def _native_workload() -> list:
    """What lockstep runs on a CPU, as calls whose inputs and models are built beforehand (random
    inputs are the workload's, not lockstep's arithmetic): every op forward and backward (fp32, bf16,
    fp16, float64), attention by prefill and paged decode and masked attention, a training step of a
    dense, a Gemma 3 and an MoE model (fp32, bf16 with fp32 master weights, float64), and the engine
    sampling an MoE model with top-k and top-p."""
    from lockstep import Engine, SamplingParams
    from lockstep.harness.attention_check import AttnCase, paged_decode
    from lockstep.harness.check import Pool, run
    from lockstep.harness.masked_attention_check import MaskedCase
    from lockstep.harness.specs import SPECS, Sizes
    from lockstep.model import ModelConfig, Transformer

    from lockstep.tools.backend_bits import ATTN, MASKED, tiny_trainer

    sizes = Sizes(hidden=40, out_features=24, heads=2, head_dim=8, ffn=24, vocab=300, lm_hidden=16, embed_vocab=20,
                  pool=12)
    calls = []
    for dtype in DTYPES + [torch.float64]:
        for spec in SPECS.values():
            pool = Pool(spec, dtype, sizes, seed=0, grad=spec.differentiable)
            calls.append(lambda pool=pool: run(pool, "native", list(range(sizes.pool))))
        case, masked = AttnCase(dtype, ATTN, seed=0), MaskedCase(dtype, MASKED, seed=0)
        calls.append(lambda case=case: case.prefill("native", list(range(len(case.seqs))), grad=True))
        calls.append(lambda case=case: paged_decode(case, "native"))
        calls.append(lambda masked=masked: masked.run("native", list(range(len(masked.seqs))), grad=True, left=True))
    tokens = torch.randint(0, 300, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    for family in ("qwen3", "gemma3_text", "qwen3_moe"):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            calls.append(tiny_trainer(family, dtype, tokens).step)
    for family, sampling in (
            ("qwen3_moe", SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_new_tokens=6, seed=1)),
            ("gemma3_text", SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.3, max_new_tokens=6,
                                           seed=2))):
        softcap = 30.0 if family == "gemma3_text" else None
        config = ModelConfig.tiny(family, vocab_size=300, final_logit_softcapping=softcap)
        engine = Engine(Transformer.from_config(config, seed=0), block_size=4, num_blocks=40)
        calls.append(lambda engine=engine, sampling=sampling: engine.generate([tokens[:9], tokens[9:14]], sampling))
    return calls


def test_nothing_lockstep_runs_on_the_native_backend_reduces_in_pytorchs_order():
    """The thread count and instruction set move PyTorch's reductions and vector math (MKL re-blocks
    fp32 GEMMs with the thread count on an Intel Xeon, ADR 0024), so the native backend's bits are
    machine-independent only if no such op runs. The ops, their gradients, the models around them,
    the trainer's step and the engine's sampler dispatch only exact ATen ops on floating-point data."""
    assert registry.cpu_backend() == "native"
    calls = _native_workload()
    audit = _AtenAudit()
    with audit:
        for call in calls:
            call()
    assert {"add", "mul", "copy_", "index_put"} <= audit.seen and len(audit.seen) > 40, sorted(audit.seen)
    assert not audit.inexact, "\n".join(f"{op}: {where}" for op, where in sorted(audit.inexact.items()))
    planted = _AtenAudit()
    with planted:
        torch.ones(3, 4) @ torch.ones(4, 2)
        torch.exp(torch.ones(3))
        torch.add(torch.ones(3), torch.ones(3), alpha=0.3)
        torch.zeros(3).index_put_((torch.tensor([0, 0]),), torch.ones(2), accumulate=True)
        torch.sqrt(torch.ones(3))
    assert set(planted.inexact) == {"aten.mm.default", "aten.exp.default", "aten.add.Tensor",
                                    "aten.index_put_.default", "aten.sqrt.default"}, planted.inexact
