"""lockstep.numerics.exact_math: powers, logs, cos and sin whose bits do not depend on the machine (ADR 0021),
held to their accuracy claims."""

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch

from lockstep.numerics import exact_math
from lockstep.sampling import uniform_noise
from lockstep.numerics.exact_math import cos_sin_float64


def _within_half_an_ulp(value: float, exact: Decimal) -> bool:
    return abs(Decimal(value) - exact) <= Decimal(math.ulp(value)) / 2


def test_power_and_log_are_correctly_rounded():
    """Against 80-digit decimal arithmetic: AdamW's bias corrections (beta^step), the rotary
    frequencies' powers, Gemma's query_pre_attn_scalar^-0.5 and the sampler's logs."""
    with localcontext() as ctx:
        ctx.prec = 80
        for x, y in [(0.9, 1), (0.95, 7), (0.999, 123_457), (1e6, Fraction(-18, 128)), (10_000.0, Fraction(-62, 64)),
                     (256.0, -0.5), (168.0, -0.5), (3.7, 2.25)]:
            exact = (Decimal(y.numerator) / Decimal(y.denominator) if isinstance(y, Fraction) else Decimal(y))
            assert _within_half_an_ulp(exact_math.power(x, y), (exact * Decimal(x).ln()).exp()), (x, y)
        for x in (1.3, 0.05, 1e-300, 7.0, 0.9999999):
            assert _within_half_an_ulp(exact_math.log(x), Decimal(x).ln()), x
    assert exact_math.power(0.0, 3) == 0.0 and exact_math.power(2.0, 0) == 1.0


def test_power_and_log_name_a_bad_argument():
    with pytest.raises(ValueError, match=r"x: expected a positive number, got -1.0"):
        exact_math.power(-1.0, 0.5)
    with pytest.raises(ValueError, match=r"x: expected a positive number, got 0.0"):
        exact_math.log(0.0)


def test_the_reduction_constants_are_pi_over_2_in_exact_parts():
    """Each part of pi/2 has at most 26 significant bits (so n * part is exact for |n| < 2^27) and
    together they are pi/2 to about 2^-100."""
    parts = exact_math._HALF_PI_PARTS
    for part in parts:
        mantissa = Fraction(part)
        while mantissa.denominator > 1:
            mantissa *= 2
        assert mantissa.numerator.bit_length() <= 26, part
    assert abs(sum(Fraction(p) for p in parts) - exact_math._PI / 2) < Fraction(1, 2 ** 100)


def test_cos_and_sin_are_within_2_to_the_minus_52_of_torchs():
    """IEEE operations alone (the same bits on every machine) against torch.cos and torch.sin, at the
    angles of positions up to 2^21, below 1e-3, negative ones, and near the range's end; exact at 0."""
    gen = torch.Generator().manual_seed(0)
    angles = torch.cat([torch.arange(0, 1 << 21, 3, dtype=torch.float64) * 0.731,
                        torch.rand(100_000, dtype=torch.float64, generator=gen) * 1e-3,
                        -torch.arange(1000, dtype=torch.float64) * 1.37,
                        2.0 ** 26 - torch.rand(1000, dtype=torch.float64, generator=gen) * 1e4])
    cos, sin = cos_sin_float64(angles)
    torch.testing.assert_close(cos, torch.cos(angles), rtol=0, atol=2.0 ** -52)
    torch.testing.assert_close(sin, torch.sin(angles), rtol=0, atol=2.0 ** -52)
    assert cos[0].item() == 1.0 and sin[0].item() == 0.0


def _cos_100_digits(x: float) -> Decimal:
    """cos x by its Taylor series in 100-digit arithmetic, after the nearest multiple of 2 pi."""
    with localcontext() as ctx:
        ctx.prec = 100
        pi = Decimal(exact_math._PI.numerator) / Decimal(exact_math._PI.denominator)
        r = Decimal(x) - 2 * pi * (Decimal(x) / (2 * pi)).to_integral_value()
        term = total = Decimal(1)
        for n in range(2, 120, 2):
            term = -term * r * r / (n * (n - 1))
            total += term
        return total


def test_scalar_cos_is_correctly_rounded():
    """exact_math.cos (the learning rate's cosine) within half an ulp of cos at 100 digits, and within
    an ulp of the C library's, over a cosine schedule's angles and some large and negative ones."""
    for x in [math.pi * p / 997 for p in range(998)] + [1e10, -2.5, 123456.789, 1e-9]:
        got = exact_math.cos(x)
        assert _within_half_an_ulp(got, _cos_100_digits(x)), x
        assert abs(got - math.cos(x)) <= math.ulp(math.cos(x)), x
    with pytest.raises(ValueError, match="x: expected a finite number below 2\\^64 in magnitude, got inf"):
        exact_math.cos(float("inf"))


@pytest.mark.parametrize("angles, message", [
    (torch.ones(3), "angles: expected float64, got torch.float32"),
    (torch.tensor([1.0, 2.0 ** 26], dtype=torch.float64),
     r"angles: expected finite values below 2\^26 in magnitude, got 67108864.0"),
    (torch.tensor([float("nan")], dtype=torch.float64), r"angles: expected finite values below 2\^26 in magnitude, got nan"),
])
def test_cos_sin_names_angles_outside_its_range(angles, message):
    with pytest.raises(ValueError, match=message):
        cos_sin_float64(angles)


def test_log_float64_is_within_3_ulp_of_torch_log():
    """At the sampler's uniforms and their -log (the Gumbel noise's two logs), in [0, 1e3), and at
    float64's ends, subnormals, 1 and its neighbours."""
    u = uniform_noise(1, 2, 300_000)
    wide = torch.rand(50_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e3
    special = torch.tensor([1.0, 2.0, 0.5, 1e-300, 1e300, 5e-324, 1 - 2 ** -53, 1 + 2 ** -52], dtype=torch.float64)
    x = torch.cat([u, -torch.log(u), wide, special])
    ours, ref = exact_math.log_float64(x).numpy(), torch.log(x).numpy()
    ulps = np.abs(ours - ref) / np.spacing(np.abs(ref)).clip(min=np.finfo(np.float64).tiny)
    assert ulps.max() <= 3, ulps.max()
    assert exact_math.log_float64(torch.tensor([1.0], dtype=torch.float64)).item() == 0.0


def test_sqrt_float64_is_within_an_ulp_of_the_ieee_root():
    """IEEE operations alone against the correctly rounded root (Python's math.sqrt), over float64's
    whole range, subnormals and the ends included; exact at 0, -0, powers of four and 1."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.exp(torch.rand(200_000, dtype=torch.float64, generator=gen) * 1400 - 700),
                   torch.rand(100_000, dtype=torch.float64, generator=gen) * 80,
                   torch.tensor([5e-324, 1e-310, 2.2250738585072014e-308, 1.7976931348623157e308, 2.0, 0.5],
                                dtype=torch.float64)])
    got = exact_math.sqrt_float64(x).tolist()
    for v, root in zip(x.tolist(), got):
        ieee = math.sqrt(v)
        assert abs(root - ieee) <= math.ulp(ieee), (v, root, ieee)
    special = torch.tensor([0.0, -0.0, 1.0, 4.0, 2.0 ** -1074 * 4, 2.0 ** 1022], dtype=torch.float64)
    assert [str(v) for v in exact_math.sqrt_float64(special).tolist()] == [
        "0.0", "-0.0", "1.0", "2.0", str(2.0 ** -536), str(2.0 ** 511)]


def test_normal_draws_are_standard_normal():
    """Two million draws: mean, variance, the share beyond 1, 2, 3 and 4 standard deviations and
    skew within 6 standard errors of the normal's (a sampler that lost the sine half, squared the
    radius, or drew one uniform twice is far outside)."""
    z = exact_math.normal((2_000_000,), torch.Generator().manual_seed(0))
    n = z.numel()
    assert abs(z.mean().item()) < 6 / n ** 0.5
    assert abs(z.var().item() - 1) < 6 * (2 / n) ** 0.5
    assert abs((z ** 3).mean().item()) < 6 * (15 / n) ** 0.5
    for k in (1, 2, 3, 4):
        p = math.erfc(k / math.sqrt(2))
        assert abs((z.abs() > k).double().mean().item() - p) < 6 * (p * (1 - p) / n) ** 0.5, k
    pairs = z.view(-1, 2)                                      # cos and sin halves are uncorrelated
    assert abs((pairs[:, 0] * pairs[:, 1]).mean().item()) < 6 / (n / 2) ** 0.5


def test_normal_draws_do_not_depend_on_how_they_are_split(monkeypatch: pytest.MonkeyPatch):
    """n values take n + n % 2 uniforms, in order: chunks of 6 values give one draw's values (odd n
    included), and a generator left after an odd draw is where rand would leave it. An odd chunk is
    refused (its last pair would straddle two chunks)."""
    one_draw = exact_math.normal((5, 7), torch.Generator().manual_seed(4))
    monkeypatch.setattr(exact_math, "NORMAL_CHUNK", 6)
    assert torch.equal(exact_math.normal((5, 7), torch.Generator().manual_seed(4)), one_draw)
    scaled = exact_math.normal((5, 7), torch.Generator().manual_seed(4), scale=0.02, dtype=torch.float32)
    assert torch.equal(scaled, (one_draw * 0.02).float())
    gen, ref = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    exact_math.normal((7,), gen)
    torch.rand(4, 2, generator=ref, dtype=torch.float64)
    assert torch.equal(gen.get_state(), ref.get_state())
    monkeypatch.setattr(exact_math, "NORMAL_CHUNK", 7)
    with pytest.raises(ValueError, match="NORMAL_CHUNK: expected an even number, got 7"):
        exact_math.normal((5,), gen)
