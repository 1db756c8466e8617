"""The native backend's bits as digests, section by section: what recorded_bits.json's
`native_backend` holds and `lockstep check` compares (docs/adr/0026).

Every op of the check harness (forward and backward, fp32, bf16, fp16 and float64, small sizes),
attention by packed prefill with gradients and by paged decode, masked attention (left padding)
with gradients, a bf16 GEMM on inputs that reach every case of the bf16 order, the model's own
arithmetic around the ops (the rotary tables, the MoE router, exact_math, a random model's
weights) and two Trainer steps with the optimizer's state. One SHA-256 digest per section (an op
in a dtype, "training", ...). The inputs come from torch's generators, whose own section says
whether they drew the recording's; the digests hold for the torch releases the recording lists.
`lockstep.backends.native.bits` is the torch-free part.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..numerics import exact_math
from ..harness.attention_check import AttnCase, AttnSizes, paged_decode
from ..harness.check import Pool, num_threads, run
from ..harness.masked_attention_check import MaskedCase, MaskedSizes
from ..harness.specs import SPECS, Sizes
from ..model import ModelConfig, Transformer
from ..model.moe import route
from ..registry import use_backend
from ..rotary import LinearRopeScaling, Llama3RopeScaling, rope_cos_sin, rope_inv_freq
from ..backends.native import bits
from ..backends.native.build import isa_name
from ..backends.native.gemm import gemm_nt
from .bench import machine

# Big enough that the GEMMs of linear, the LM head and attention run on several threads (gemm.c
# keeps products under 2^18 multiply-adds on one), small enough for the scalar path.
SIZES = Sizes(hidden=264, out_features=100, heads=2, head_dim=16, ffn=40, vocab=4200, lm_hidden=72, embed_vocab=20,
              pool=40)
ATTN = AttnSizes(lens=(20, 1, 90), q_heads=4, kv_heads=2, head_dim=40, chunks=(7,))
MASKED = MaskedSizes(lens=(20, 1, 90), q_heads=4, kv_heads=2, head_dim=40)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Workload:
    """How much arithmetic each section runs. The recorded bits are WORKLOAD's. A smaller one runs
    the same sections through the same code paths, for a comparison whose both sides are computed
    (an emulated CPU, where every multiply-add costs a helper call, against this one)."""
    sizes: Sizes = SIZES
    attn: AttnSizes = ATTN
    masked: MaskedSizes = MASKED
    trained: tuple[tuple[str, int], ...] = ()  # ModelConfig.tiny's overrides for the trained model
    micro_batch_tokens: int = 96
    rope_step: int = 97                        # rotary positions 0, step, 2 step, ... below 2^20


WORKLOAD = Workload()


def _update(h: "hashlib._Hash", label: str, t: torch.Tensor | None) -> None:
    h.update(label.encode())
    if t is not None:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def bf16_edge_operands(rows: int = 64, k: int = 103) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 GEMM operands that reach every case of the bf16 order (kernels.c): rows of tiny values
    and denormals whose products and partial sums fall at and just below 2^-126 (where the order
    flushes what plain rounding keeps), rows that cancel their neighbours, rows of ordinary values,
    Inf and NaN in every 16th row, and row 2 of each operand the constructed tininess case."""
    gen = torch.Generator().manual_seed(11)
    tiny = torch.arange(rows)[:, None] % 3 != 2                     # two rows in three
    exponent = torch.where(tiny, 62 + torch.randint(0, 4, (rows, k), generator=gen),
                           110 + torch.randint(0, 30, (rows, k), generator=gen))
    exponent = torch.where(torch.rand(rows, k, generator=gen) < 0.1, 0, exponent)       # zeros and denormals
    special = (torch.arange(rows)[:, None] % 16 == 6) & (torch.rand(rows, k, generator=gen) < 0.05)
    exponent = torch.where(special, 255, exponent)                                      # Inf and NaN
    bits = (torch.randint(0, 2, (rows, k), generator=gen) << 15) | (exponent << 7) | torch.randint(
        0, 128, (rows, k), generator=gen)
    x = bits.to(torch.int16).view(torch.bfloat16)
    x[1::4] = -x[0::4][: x[1::4].shape[0]]                          # rows that cancel their neighbours
    a, b = x, x.flip(0).roll(3, 1)
    a[2], b[2] = BF16_TININESS
    return a, b


def _tininess_case(k: int = 103) -> tuple[torch.Tensor, torch.Tensor]:
    """One row pair whose dot is exactly 0 in the bf16 order and 2^-126 with plain rounding: lane 0
    reaches 2^-126 + 2^-149, then adds -1.375 x 2^-149; the exact sum, rounded to 24 bits with an
    unbounded exponent, is 2^-126 - 2^-150, tiny, so it is flushed (kernels.c's header)."""
    a, b = torch.zeros(k), torch.zeros(k)
    a[1], b[1] = 2.0 ** -63, 2.0 ** -63             # odd step of chunk 0: 2^-126
    a[0], b[0] = 2.0 ** -75, 2.0 ** -74             # even step: + 2^-149
    a[33], b[33] = -1.375 * 2.0 ** -75, 2.0 ** -74  # odd step of chunk 1: - 1.375 x 2^-149
    return a.bfloat16(), b.bfloat16()


BF16_TININESS = _tininess_case()

ROPES = ((128, 1_000_000.0, None), (64, 10_000.0, None), (128, 500_000.0, Llama3RopeScaling()),
         (256, 1_000_000.0, LinearRopeScaling(8.0)))


def _model_arithmetic(h: "hashlib._Hash", work: Workload = WORKLOAD) -> None:
    """The rotary tables at positions up to 2^20, the MoE router on logits of a real router's range
    (fp32 probabilities through exp, 8 of 16 experts, renormalised, and the logits' gradient), and
    exact_math's float64 functions over float64's positive range (inputs from bit patterns, so
    they are the same everywhere) and its normal draws in float64 (where a last-bit change shows,
    unlike in weights rounded to fp32), and a random model's weights (from_config)."""
    wide = (torch.arange(1, 4002, dtype=torch.int64) * (0x7FEFFFFFFFFFFFFF // 4001)).view(torch.float64)
    _update(h, "log_float64", exact_math.log_float64(wide))
    _update(h, "sqrt_float64", exact_math.sqrt_float64(wide))
    _update(h, "normal", exact_math.normal((20_001,), torch.Generator().manual_seed(3)))
    for name, p in Transformer.from_config(ModelConfig.tiny("qwen3"), seed=3).state_dict().items():
        _update(h, f"from_config {name}", p)
    positions = torch.arange(0, 1 << 20, work.rope_step)
    for head_dim, theta, scaling in ROPES:
        _update(h, f"inv_freq {head_dim} {theta} {scaling}", rope_inv_freq(head_dim, theta, scaling))
        for dtype in (torch.float32, torch.bfloat16):
            for i, t in enumerate(rope_cos_sin(positions, head_dim, theta, scaling, dtype)):
                _update(h, f"rope table {head_dim} {theta} {scaling} {dtype} {i}", t)
    gen = torch.Generator().manual_seed(5)
    logits = (torch.rand(64, 16, generator=gen) * 16 - 8).requires_grad_(True)
    weights, experts = route(logits, 8, True)
    weights.backward(torch.rand(64, 8, generator=gen) - 0.5)
    for label, t in (("weights", weights), ("experts", experts), ("d logits", logits.grad)):
        _update(h, f"router {label}", t)


def tiny_trainer(family: str, dtype: torch.dtype, tokens: list[int], model: dict | None = None, **config):
    """A Trainer of a random tiny model of `family` (vocabulary 300; `model` overrides more of
    ModelConfig.tiny) in `dtype` (bf16 with fp32 master weights) over `tokens`: sequences of 32,
    micro-batches of 96 tokens, 2 per step."""
    from ..train import PackedDataset, TrainConfig, Trainer

    cfg = TrainConfig(**{"steps": 1, "seq_len": 32, "micro_batch_tokens": 96, "accum": 2, "lr": 3e-3, "warmup": 1,
                         "seed": 0, "master_weights": dtype == torch.bfloat16, **config})
    model = Transformer.from_config(ModelConfig.tiny(family, **{"vocab_size": 300, **(model or {})}), seed=0,
                                    dtype=dtype)
    return Trainer(model, PackedDataset(tokens, cfg.seq_len, cfg.micro_batch_tokens, cfg.seed), cfg)


def _training(h: "hashlib._Hash", work: Workload = WORKLOAD) -> None:
    """Two Trainer steps of a random Qwen3 (fp32, and bf16 with fp32 master weights): the weights and
    the optimizer's state after them, AdamW's square root and the gradient norm's included."""
    tokens = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        trainer = tiny_trainer("qwen3", dtype, tokens, dict(work.trained), steps=2, grad_clip=0.5,
                               micro_batch_tokens=work.micro_batch_tokens)
        for _ in range(2):
            trainer.step()
        for name, t in [*trainer.model.state_dict().items(), *trainer.opt.state_tensors().items()]:
            _update(h, f"trained {dtype} {name}", t)


# The section that holds torch's samplers alone: where it differs, the inputs of every other do too.
GENERATORS = "torch generators"


def _generators(h: "hashlib._Hash") -> None:
    """torch's samplers as the inputs of the other sections take them, from seeded generators, on a
    few values and on enough for any vector path: randn in float64 rounded to float32 (the harness
    rounds its float64 normals to the dtype under test), rand, randint and randperm. Not randn's
    float64 bits themselves: its sampler takes the C library's log and cos, whose FMA and plain
    variants differ in the last bit (QEMU's Sandy Bridge), which rounding to fp32 hides. Not randn
    in float32 either, which no input here uses: its vector sampler gives other bits than its scalar
    one (ATen's default capability), which is why exact_math.normal exists."""
    for n in (7, 4099):
        gen = torch.Generator().manual_seed(n)
        for label, t in (("randn float64 as float32", torch.randn(n, generator=gen, dtype=torch.float64).float()),
                         ("rand float64", torch.rand(n, generator=gen, dtype=torch.float64)),
                         ("rand float32", torch.rand(n, generator=gen)),
                         ("randint", torch.randint(0, 1 << 30, (n,), generator=gen)),
                         ("randperm", torch.randperm(n, generator=gen))):
            _update(h, f"{label} {n}", t)


def _machine_independent(tensors, low_bits: torch.Generator) -> None:
    """Give float64 inputs full significands that are the same on every machine, in place. The
    harness draws float64 normals, whose last bits follow the C library (`_generators`); each value
    is rounded to fp32 (the same everywhere), then moved by 2^-26 of itself times an fp32-valued
    draw from `low_bits`, and one float64 rounding fills it out to 53 bits, so that products round,
    as they do in use. Inf and NaN stay as they are."""
    for t in tensors:
        if t.dtype == torch.float64:
            high = t.float().double()
            low = torch.randn(t.shape, generator=low_bits, dtype=torch.float64).float().double()
            t.copy_(torch.where(high.isfinite(), high + high * low * 2.0 ** -26, high))


class _MachineIndependentMasked(MaskedCase):
    """MaskedCase whose float64 draws (its padding's too) are `_machine_independent`."""

    def __init__(self, *args, **kwargs):
        self.low_bits = torch.Generator().manual_seed(19)
        super().__init__(*args, **kwargs)

    def _randn(self, heads: int, n: int) -> torch.Tensor:
        x = super()._randn(heads, n)
        _machine_independent([x], self.low_bits)
        return x


def _cases(dtype: torch.dtype, spec, sizes: Sizes = SIZES) -> Pool:
    """The check pool of `spec` in `dtype`, its float64 inputs `_machine_independent`."""
    pool = Pool(spec, dtype, sizes, seed=0, grad=spec.differentiable)
    if dtype == torch.float64:
        _machine_independent([*pool.rows.values(), *pool.params.values(), pool.dy, *pool.garbage_dy.values(),
                              *(t for rows in pool.garbage.values() for t in rows.values())],
                             torch.Generator().manual_seed(17))
    return pool


def digests(work: Workload = WORKLOAD) -> dict[str, str]:
    """{section: sha256 hex} over every section named in the module docstring and GENERATORS, on the
    native backend whatever backend the caller selected, with gradients on, at torch's thread count."""
    with use_backend("native"), torch.enable_grad():
        return _digests(work)


def _digests(work: Workload) -> dict[str, str]:
    sections: dict[str, "hashlib._Hash"] = {}

    def section(name: str) -> "hashlib._Hash":
        return sections.setdefault(name, hashlib.sha256())

    _generators(section(GENERATORS))
    a, b = bf16_edge_operands()
    _update(section("bf16 edge GEMM"), "bf16 edge GEMM", gemm_nt(a, b))
    _model_arithmetic(section("model arithmetic"), work)
    _training(section("training"), work)
    for dtype in DTYPES:
        kind = str(dtype).removeprefix("torch.")
        for name, spec in SPECS.items():
            h = section(f"{name} {kind}")
            r = run(_cases(dtype, spec, work.sizes), "native", list(range(work.sizes.pool)))
            _update(h, f"{name} {dtype} out", r.out)
            for key in sorted(r.row_grads):
                _update(h, f"{name} {dtype} d{key}", r.row_grads[key])
            for key in sorted(r.param_grads):
                _update(h, f"{name} {dtype} d{key}", r.param_grads[key])
        h = section(f"attention {kind}")
        case = AttnCase(dtype, work.attn, seed=0)
        if dtype == torch.float64:
            _machine_independent([t for seq in case.seqs + case.garbage for t in (seq.q, seq.k, seq.v, seq.do)],
                                 torch.Generator().manual_seed(18))
        per, _ = case.prefill("native", list(range(len(case.seqs))), grad=True)
        for i, tensors in enumerate(per):
            for j, t in enumerate(tensors):
                _update(h, f"attention {dtype} {i} {j}", t)
        for i, t in enumerate(paged_decode(case, "native")):
            _update(section(f"paged_attention {kind}"), f"paged_attention {dtype} {i}", t)
        masked = (_MachineIndependentMasked if dtype == torch.float64 else MaskedCase)(dtype, work.masked, seed=0)
        h = section(f"masked_attention {kind}")
        for i, tensors in enumerate(masked.run("native", list(range(len(masked.seqs))), grad=True, left=True)):
            for j, t in enumerate(tensors):
                _update(h, f"masked_attention {dtype} {i} {j}", t)
    return {name: h.hexdigest() for name, h in sections.items()}


def release(version: str) -> str:
    """A torch version without its local part: "2.13.0+cpu" -> "2.13.0". The recording lists releases,
    taking a CUDA build and the CPU build of one release to run the same CPU code (each release was
    checked in one build only)."""
    return version.split("+")[0]


def compare(recorded: dict) -> dict:
    """This machine's digests, on 2 threads, against `recorded` (bits.recorded()): {"torch": this
    release, "listed": whether the recording was made or checked under it, "sections": how many
    sections it holds, "differ": the sections whose bits are not the recorded ones, "counted":
    whether that is a failure}. It is not where torch's generators draw other inputs than the
    recording's (another release or C library), nor under a release the recording does not list,
    whose generators may."""
    with num_threads(2):
        got = digests()
    this = release(torch.__version__)
    differ = bits.differing(got, recorded["native_backend"])
    listed = this in recorded["torch"]
    return {"torch": this, "listed": listed, "sections": len(recorded["native_backend"]), "differ": differ,
            "counted": bool(differ) and listed and GENERATORS not in differ}


def against_recording(log: Callable[[str], None] = print) -> dict:
    """Compare this machine's native bits with the recorded ones (docs/adr/0026), logging one line
    for each part as it is done: the kernels on every instruction set this CPU runs
    (bits.compare), then the whole backend (`compare`) on the instruction set in use. Returns
    {"recorded_on", "instruction_sets", "differ": {isa: kernel groups}, "backend": compare's
    result, "failed"}; a difference in the whole backend fails only where `compare` counts it.
    Raises ValueError where the recording cannot be read."""
    recorded = bits.recorded()
    found, on = bits.compare(recorded["kernels"]), recorded["recorded_on"]
    differ = {isa: names for isa, names in found.items() if names}
    if differ:
        log(f"native bits: FAIL: {bits.mismatch(f'On this machine ({machine()}) the kernels', differ, on)}")
    else:
        log(f"native bits: the recorded ones on {', '.join(found)} (recorded on {on['machine']}, {on['isa']})")
    backend = compare(recorded)
    if not backend["differ"]:
        log(f"native backend bits: the recorded ones in all {backend['sections']} sections (ops forward and "
            f"backward, attention, the model's arithmetic, training) under torch {backend['torch']}")
    elif backend["counted"]:
        what = f"On this machine ({machine()}, torch {backend['torch']}) the native backend"
        log(f"native backend bits: FAIL: {bits.mismatch(what, {isa_name(): backend['differ']}, on)}")
    elif GENERATORS in backend["differ"]:
        log(f"native backend bits: other than the recorded ones in {len(backend['differ'])} of "
            f"{backend['sections']} sections, and torch's generators draw other numbers here than on "
            f"{on['machine']} (torch {backend['torch']} or this C library), so the inputs differ and this is not "
            "counted as a failure")
    else:
        log(f"native backend bits: other than the recorded ones in {', '.join(backend['differ'])} under torch "
            f"{backend['torch']}, which the recording does not list (torch {', '.join(recorded['torch'])}): its "
            "generators may draw other inputs, so this is not counted as a failure")
    return {"recorded_on": on, "instruction_sets": list(found), "differ": differ, "backend": backend,
            "failed": bool(differ) or backend["counted"]}
