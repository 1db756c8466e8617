"""lockstep.exact_math: powers, logs, cos and sin whose bits do not depend on the machine (ADR 0021),
held to their accuracy claims."""

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import pytest
import torch

from lockstep import exact_math
from lockstep.exact_math import cos_sin_float64


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
