"""Math whose bits do not depend on the machine.

PyTorch's transcendental kernels give other last bits in their vector and scalar paths, and the C
library picks FMA or plain variants of its functions from the CPU (glibc's pow, cos and log). So
wherever lockstep needs such a value in a computation whose bits it promises, it takes it from here:

- `power` and `log` of Python floats: evaluated in 50-digit decimal arithmetic (Python's software
  arithmetic, the same everywhere), then rounded once to float64.
- `cos` on one Python float: its Taylor series in the same decimal arithmetic.
- `cos_sin_float64` on float64 tensors: from IEEE additions, multiplications and roundings alone,
  each its own PyTorch kernel, so the same bits on every CPU, vector unit and GPU.
"""

from __future__ import annotations

import math
from decimal import Context, Decimal
from fractions import Fraction

import torch
from torch import Tensor

_CONTEXT = Context(prec=50)


def power(x: float, y: float | Fraction) -> float:
    """x^y for x > 0 (or x = 0 and y > 0, which gives 0), correctly rounded to float64 but in the
    rarest cases; y a float, an int or a Fraction (exactly: Fraction(-2, 3) is -2/3, not its float)."""
    if x == 0 and y > 0:
        return 0.0
    if not x > 0:
        raise ValueError(f"x: expected a positive number, got {x!r}")
    exponent = _CONTEXT.divide(Decimal(y.numerator), Decimal(y.denominator)) if isinstance(y, Fraction) else Decimal(y)
    return float(_CONTEXT.exp(_CONTEXT.multiply(exponent, _CONTEXT.ln(Decimal(x)))))


def log(x: float) -> float:
    """The natural log of x > 0, correctly rounded to float64 but in the rarest cases."""
    if not x > 0:
        raise ValueError(f"x: expected a positive number, got {x!r}")
    return float(_CONTEXT.ln(Decimal(x)))


_PI = Fraction(Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899"))


def _leading_parts(value: Fraction, parts: int, bits: int) -> tuple[float, ...]:
    """`value` > 0 as a sum of `parts` floats of at most `bits` significant bits each, and a
    remainder below the last: n * part is exact in float64 for |n| < 2^(53 - bits)."""
    out = []
    for _ in range(parts):
        exponent = value.numerator.bit_length() - value.denominator.bit_length()
        if value < Fraction(2) ** exponent:              # floor(log2(value))
            exponent -= 1
        scale = Fraction(2) ** (bits - 1 - exponent)
        part = Fraction(math.floor(value * scale)) / scale
        out.append(float(part))
        value -= part
    return tuple(out)


# pi/2 in four 26-bit parts: every product n * part of the reduction is exact for |n| < 2^27.
_HALF_PI_PARTS = _leading_parts(_PI / 2, 4, 26)
_TWO_OVER_PI = float(2 / _PI)
# |angle| below this keeps n below 2^27.
MAX_ANGLE = 2.0 ** 26
# Taylor coefficients, each 1/n! correctly rounded: sin to r^17, cos to r^18; on |r| <= pi/4 the
# first omitted terms are below 2^-60 of the result.
_SIN_COEFFS = tuple(float(Fraction((-1) ** k, math.factorial(2 * k + 1))) for k in range(1, 9))
_COS_COEFFS = tuple(float(Fraction((-1) ** k, math.factorial(2 * k))) for k in range(1, 10))


def cos_sin_float64(angles: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin) of float64 `angles` (any shape and device; finite, |angle| < MAX_ANGLE = 2^26)
    from IEEE additions, multiplications and roundings alone. Each is its own kernel, so nothing
    is fused into an FMA, and the bits are the same on every device and vector unit. Measured within
    2^-52 (absolute) of torch.cos and torch.sin (tests/test_exact_math.py).

    The angle is reduced by the nearest multiple n of pi/2 (Cody-Waite, in four exact products);
    cos and sin of the remainder r (|r| <= pi/4) are Taylor series in r^2 by Horner's rule; n mod 4
    picks which of +-cos r, +-sin r each result is."""
    if angles.dtype != torch.float64:
        raise ValueError(f"angles: expected float64, got {angles.dtype}")
    if angles.numel() and not bool((angles.abs() < MAX_ANGLE).all()):
        bad = angles[~(angles.abs() < MAX_ANGLE)][0].item()
        raise ValueError(f"angles: expected finite values below 2^26 in magnitude, got {bad!r}")
    n = torch.round(angles * _TWO_OVER_PI)
    r = angles
    for part in _HALF_PI_PARTS:
        r = r - n * part
    z = r * r
    sin_r = r + (r * z) * _horner(z, _SIN_COEFFS)
    cos_r = 1.0 + z * _horner(z, _COS_COEFFS)
    quadrant = n.to(torch.int64)
    odd = (quadrant & 1) == 1                     # quadrants 1 and 3 swap cos and sin
    cos = torch.where(odd, sin_r, cos_r)
    sin = torch.where(odd, cos_r, sin_r)
    cos = torch.where(((quadrant + 1) & 2) == 2, -cos, cos)     # negative in quadrants 1 and 2
    sin = torch.where((quadrant & 2) == 2, -sin, sin)           # negative in quadrants 2 and 3
    return cos, sin


def cos(x: float) -> float:
    """cos of one finite float, correctly rounded to float64 but in the rarest cases: its Taylor
    series in 50-digit decimal arithmetic after subtracting the nearest multiple of 2 pi (pi to 80
    digits)."""
    if not math.isfinite(x) or abs(x) >= 2.0 ** 64:
        raise ValueError(f"x: expected a finite number below 2^64 in magnitude, got {x!r}")
    two_pi = 2 * Decimal(_PI.numerator) / Decimal(_PI.denominator)
    r = _CONTEXT.subtract(Decimal(x), _CONTEXT.multiply(two_pi, (Decimal(x) / two_pi).to_integral_value()))
    r2, term, total, n = _CONTEXT.multiply(r, r), Decimal(1), Decimal(1), 0
    while abs(term) > Decimal("1e-60"):
        n += 2
        term = _CONTEXT.divide(_CONTEXT.multiply(-term, r2), Decimal(n * (n - 1)))
        total = _CONTEXT.add(total, term)
    return float(total)


def _horner(z: Tensor, coeffs: tuple[float, ...]) -> Tensor:
    """coeffs[0] + coeffs[1] z + coeffs[2] z^2 + ..., from the highest term down."""
    acc = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * z + c
    return acc
