"""float64 on the native backend (float64.c, docs/adr/0027): the GEMM's documented order, its bits
on every instruction set and thread count, every op's invariance, and exp, log and sqrt as
documented."""

from __future__ import annotations

import decimal
import math
from fractions import Fraction

import pytest
import torch

from lockstep.numerics import exact_math, fixed_order
from lockstep.backends.native import build, gemm, unary
from lockstep.backends.native.cpu import KERNELS
from lockstep.harness.check import num_threads

from _native_helpers import isa  # noqa: F401  (fixtures)


def _fma64(a: float, b: float, s: float) -> float:
    """float64 fma: the exact a * b + s (Fractions), rounded once (float() of a Fraction rounds to nearest even)."""
    return float(Fraction(a) * Fraction(b) + Fraction(s))


def test_float64_gemm_order_is_the_documented_one(monkeypatch):
    """float64 takes the fp32 order in double precision (docs/adr/0027), restated in Python: 16
    lanes over K, each one float64 FMA chain from k = 0 (emulated exactly with Fractions), folded by
    the fixed tree, the bias added once after it. K = 45 leaves a tail; 3 x 5 outputs leave partial
    micro-tiles; in every instruction set, with one row or one column alone."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 45, generator=gen, dtype=torch.float64)
    b = torch.randn(5, 45, generator=gen, dtype=torch.float64)
    bias = torch.randn(5, generator=gen, dtype=torch.float64)
    got = gemm.gemm_nt(a, b, bias, out_dtype=torch.float64)
    for m in range(3):
        for n in range(5):
            lanes = [0.0] * 16
            for k in range(45):
                lanes[k % 16] = _fma64(a[m, k].item(), b[n, k].item(), lanes[k % 16])
            t = [lanes[j] + lanes[j + 8] for j in range(8)]
            u = [t[j] + t[j + 4] for j in range(4)]
            v = [u[j] + u[j + 2] for j in range(2)]
            assert got[m, n].item() == (v[0] + v[1]) + bias[n].item(), (m, n)
    for name in build.supported_isas():
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", name)
        assert torch.equal(gemm.gemm_nt(a, b, bias, out_dtype=torch.float64), got), name
        assert torch.equal(gemm.gemm_nt(a[1:2], b, bias, out_dtype=torch.float64), got[1:2]), name
        assert torch.equal(gemm.gemm_nt(a, b[3:4], bias[3:4], out_dtype=torch.float64), got[:, 3:4]), name
    # Row and batch strides other than K and M K, and an output wider than N, as the kernel reads them.
    a2, b2 = torch.randn(3, 45, generator=gen, dtype=torch.float64), torch.randn(5, 45, generator=gen, dtype=torch.float64)
    spaced_a, spaced_b = torch.zeros(2, 4, 50, dtype=torch.float64), torch.zeros(2, 6, 47, dtype=torch.float64)
    spaced_a[0, :3, :45], spaced_a[1, :3, :45], spaced_b[0, :5, :45], spaced_b[1, :5, :45] = a, a2, b, b2
    out = torch.full((2, 3, 9), math.nan, dtype=torch.float64)
    gemm.gemm_nt(spaced_a[:, :3, :45], spaced_b[:, :5, :45], out=out[:, :, 2:7], out_dtype=torch.float64)
    assert torch.equal(out[0, :, 2:7], gemm.gemm_nt(a, b, out_dtype=torch.float64))
    assert torch.equal(out[1, :, 2:7], gemm.gemm_nt(a2, b2, out_dtype=torch.float64))
    assert out[:, :, :2].isnan().all() and out[:, :, 7:].isnan().all()
    lib, code = build.library(), build.isa()
    x = torch.ones(4, dtype=torch.float64)
    assert lib.ls_unary_f64(x.data_ptr(), x.data_ptr(), 4, 3, code, 1) == -1            # no function 3
    assert lib.ls_unary_f64(x.data_ptr(), x.data_ptr(), -1, 0, code, 1) == -1
    assert lib.ls_gemm_nt_f64(1, -1, 1, 1, x.data_ptr(), 1, 0, x.data_ptr(), 1, 0, x.data_ptr(), 1, 0, None, code,
                              1) == -1


def test_float64_on_the_native_backend_keeps_every_invariance():
    """Section 2 for float64 on the native backend (docs/adr/0027), bitwise: every op's layout sweeps
    (other batches, padding and NaN rows, strided, repeat, 1 vs 2 threads), attention's (alone,
    reversed, beside NaN sequences, padding, chunked prefill, paged decode) and masked attention's.
    On PyTorch's float64 GEMMs these follow the BLAS (under QEMU's Haswell: the thread count and the
    row count). The contract has no float64 tolerance, so the sweeps alone."""
    from lockstep.harness.attention_check import AttnSizes, check_attention
    from lockstep.harness.check import Pool, invariance
    from lockstep.harness.masked_attention_check import MaskedSizes, check_masked_attention
    from lockstep.harness.specs import SPECS, Sizes

    sizes = Sizes(hidden=40, out_features=24, heads=2, head_dim=8, ffn=24, vocab=300, lm_hidden=16, embed_vocab=20,
                  pool=12)
    failed = []
    for name, spec in SPECS.items():
        sweeps, _ = invariance(Pool(spec, torch.float64, sizes, seed=0, grad=spec.differentiable), "native", 0)
        failed += [f"{name}: {s.sweep}: {s.detail}" for s in sweeps if not s.passed]
    for report in (check_attention(torch.float64, "native", with_accuracy=False,
                                   sizes=AttnSizes(lens=(20, 1, 70), head_dim=16, chunks=(7,))),
                   check_masked_attention(torch.float64, "native", with_accuracy=False,
                                          sizes=MaskedSizes(lens=(20, 1, 70), head_dim=16))):
        failed += [f"{report.op}: {s.sweep}: {s.detail}" for s in report.sweeps if not s.passed]
        assert len(report.sweeps) > 5
    assert not failed, failed


def test_a_products_dtype_follows_its_first_operand():
    """A float64 operand beside a 16- or 32-bit first one is rounded to fp32, as torch_weight_grad
    rounds it; a float64 first operand makes a float64 product, the other widened exactly."""
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 40, generator=gen), torch.randn(40, 5, generator=gen, dtype=torch.float64)
    g, x = torch.randn(6, 3, generator=gen), torch.randn(6, 7, generator=gen, dtype=torch.float64)
    mm, wg = fixed_order.matmul_rows, fixed_order.weight_grad
    assert torch.equal(mm(a, b, kernels=KERNELS), mm(a, b.float(), kernels=KERNELS))
    assert torch.equal(wg(g, x, kernels=KERNELS), wg(g, x.float(), kernels=KERNELS))
    wide = mm(b.t(), a.t(), kernels=KERNELS)
    assert wide.dtype == torch.float64 and torch.equal(wide, mm(b.t(), a.t().double(), kernels=KERNELS))
    wide = wg(x, g, kernels=KERNELS)
    assert wide.dtype == torch.float64 and torch.equal(wide, wg(x, g.double(), kernels=KERNELS))


@pytest.mark.parametrize("k", [1029, 4133], ids=lambda k: f"K={k}")
def test_float64_gemm_bits_across_instruction_sets_threads_and_rows(k, isa):
    """The float64 products linear and weight gradients make (through fixed_order, which takes
    float64 to the kernels), batched too: the same bits in every instruction set and on 1, 2 and 3
    threads, a row's and a column's bits those of the whole call, and each the kernel's documented
    dot (test_float64_gemm_order_is_the_documented_one) of its rows. On QEMU's Haswell, MKL's float64
    GEMM gave other bits on 1 and 2 threads and for the first 8 rows alone (docs/adr/0027)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, k, generator=gen, dtype=torch.float64)
    b = torch.randn(301, k, generator=gen, dtype=torch.float64)
    bias = torch.randn(301, generator=gen, dtype=torch.float64)
    g = torch.randn(37, 40, generator=gen, dtype=torch.float64)
    batched = torch.randn(3, 9, k, generator=gen, dtype=torch.float64)
    outs = []
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append((fixed_order.matmul_rows(a, b.t(), bias, kernels=KERNELS),
                         fixed_order.weight_grad(g, a, kernels=KERNELS),
                         fixed_order.matmul_rows(batched, batched.transpose(-1, -2), kernels=KERNELS)))
    for other in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(outs[0], other))
    y = outs[0][0]
    assert torch.equal(fixed_order.matmul_rows(a[5:6], b.t(), bias, kernels=KERNELS), y[5:6])
    assert torch.equal(fixed_order.matmul_rows(a[:8], b.t(), bias, kernels=KERNELS), y[:8])
    assert torch.equal(fixed_order.matmul_rows(a, b[7:9].t(), bias[7:9], kernels=KERNELS), y[:, 7:9])
    assert y.dtype == torch.float64 and torch.equal(y, gemm.gemm_nt(a, b, bias, out_dtype=torch.float64))
    assert torch.equal(outs[0][1], gemm.gemm_nt(g.t().contiguous(), a.t().contiguous(), out_dtype=torch.float64))
    assert torch.equal(outs[0][2], torch.stack([gemm.gemm_nt(t, t, out_dtype=torch.float64) for t in batched]))


# 1 / i!, correctly rounded: the Taylor coefficients of float64.c's exp.
_EXP_TAYLOR = [float(Fraction(1, math.factorial(i))) for i in range(14)]


def _exp64(x: float) -> float:
    """float64.c's exp restated in Python's float64 arithmetic (each operation IEEE-rounded
    once): n = x log2 e rounded to nearest even; r = x - n ln2 in two parts; Taylor to r^13 by
    Horner's rule; times 2^n in two exact-exponent steps."""
    if x != x:
        return x
    if x > float.fromhex("0x1.62e42fefa39efp+9"):
        return math.inf
    if x < -float.fromhex("0x1.74910d52d3051p+9"):
        return 0.0
    n = (x * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0     # + 1.5 x 2^52: rint
    r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10
    p = _EXP_TAYLOR[13]
    for c in reversed(_EXP_TAYLOR[:13]):
        p = p * r + c
    n1 = int(n / 2)
    return (p * 2.0 ** n1) * 2.0 ** (int(n) - n1)


def test_float64_exp_log_and_sqrt_are_the_documented_arithmetic_in_every_instruction_set(monkeypatch):
    """float64 exp and log are one C code on every path (docs/adr/0027): exp is `_exp64` bit for
    bit; log is exact_math.log_float64 (the sampler's) bit for bit; sqrt is the IEEE root. Against
    exact values (50-digit decimals) exp is within 1 ulp and log within 2; the special values and
    the overflow and underflow edges are IEEE's; the bits are the same in every instruction set
    and on 3 threads."""
    gen = torch.Generator().manual_seed(7)
    top, bottom = float.fromhex("0x1.62e42fefa39efp+9"), -float.fromhex("0x1.74910d52d3051p+9")
    edges = [top, math.nextafter(top, math.inf), bottom, math.nextafter(bottom, -math.inf), -708.4, 0.0, -0.0,
             math.inf, -math.inf, math.nan]
    x = torch.cat([torch.rand(40_000, generator=gen, dtype=torch.float64) * 1500 - 750,
                   torch.randn(40_000, generator=gen, dtype=torch.float64), torch.tensor(edges, dtype=torch.float64)])
    pos = torch.cat([torch.exp(torch.rand(40_000, generator=gen, dtype=torch.float64) * 1400 - 700),
                     torch.tensor([5e-324, 2.2250738585072014e-308, 1.0 + 2 ** -52, 1.0 - 2 ** -53, 2 ** 0.5,
                                   1.7976931348623157e308], dtype=torch.float64)])
    results = []
    for name in build.supported_isas():
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", name)
        results.append((unary.exp(x), unary.log(pos), unary.log(x), unary.sqrt(x)))
    with num_threads(3):
        results.append((unary.exp(x), unary.log(pos), unary.log(x), unary.sqrt(x)))
    for other in results[1:]:
        for u, v in zip(results[0], other):
            assert torch.equal(u.view(torch.int64), v.view(torch.int64))
    e, lg, lgx, root = results[0]
    assert e.dtype == lg.dtype == lgx.dtype == root.dtype == torch.float64
    want = torch.tensor([_exp64(v) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(e.view(torch.int64), want.view(torch.int64))
    assert torch.equal(lg, exact_math.log_float64(pos))
    real = x >= 0
    assert torch.equal(root[real], torch.tensor([math.sqrt(v) for v in x[real].tolist()], dtype=torch.float64))
    assert root[x < 0].isnan().all() and root[-1].isnan() and math.copysign(1.0, root[-4].item()) == -1.0

    context = decimal.Context(prec=50)

    def exact(f, v: float) -> float:
        return float(f(decimal.Decimal(v)))

    def ulps(got: float, exact_value: float) -> float:
        return abs(got - exact_value) / math.ulp(exact_value)

    for v, got in zip(x[::97].tolist(), e[::97].tolist()):
        if 2.3e-308 < got < 1.7e308:
            assert ulps(got, exact(context.exp, v)) <= 1, v
    for v, got in zip(pos[::97].tolist() + pos[-6:].tolist(), lg[::97].tolist() + lg[-6:].tolist()):
        assert ulps(got, exact(context.ln, v)) <= 2, v
    tail = e[-len(edges):].tolist()
    assert tail[0] < math.inf and tail[1] == math.inf                  # the overflow edge
    assert tail[2] == exact(context.exp, bottom) > 0 and tail[3] == 0.0    # the underflow edge
    assert tail[4] == exact(context.exp, -708.4)                       # a subnormal result
    assert tail[5:9] == [1.0, 1.0, math.inf, 0.0] and math.isnan(tail[9])
    tail = lgx[-len(edges):].tolist()
    assert tail[5:8] == [-math.inf, -math.inf, math.inf] and math.isnan(tail[8]) and math.isnan(tail[9])
    assert lgx[x < 0].isnan().all()
