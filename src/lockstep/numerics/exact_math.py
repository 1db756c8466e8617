"""Math whose bits do not depend on the machine.

PyTorch's transcendental kernels give other last bits in their vector and scalar paths, and the C
library picks FMA or plain variants of its functions from the CPU (glibc's pow, cos and log). So
wherever lockstep needs such a value in a computation whose bits it promises, it takes it from here:

- `power` and `log` of Python floats: evaluated in 50-digit decimal arithmetic (Python's software
  arithmetic, the same everywhere), then rounded once to float64.
- `cos` on one Python float: its Taylor series in the same decimal arithmetic.
- `cos_sin_float64` and `log_float64` on float64 tensors: from IEEE additions, multiplications,
  divisions and roundings alone, each its own PyTorch kernel, so the same bits on every CPU, vector
  unit and GPU.
- `sqrt_float64` likewise: torch.sqrt on a CPU tensor goes through MKL's vector math, which picks
  its code by the CPU's maker and vector unit.
- `normal`: standard normal draws from a torch.Generator, by Box-Muller on the functions above
  (torch.randn's vector and scalar samplers give other normals for one seed).
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


_LN2_HI = 6.93147180369123816490e-01     # ln 2 split so that e * _LN2_HI is exact for |e| < 2^11
_LN2_LO = 1.90821492927058770002e-10


def log_float64(x: Tensor) -> Tensor:
    """ln(x) for float64 x > 0 (finite; other values give no promised result, and are not
    checked, since the sampler calls this on every step on any device) from IEEE additions,
    multiplications and divisions alone, so that its bits do not depend on the CPU's vector unit.
    torch.log on float64 goes through a vectorized math library whose last bit may follow the
    instruction set; the sampler's Gumbel noise decides ties between tokens with it.

    x = m 2^e with m in [sqrt(1/2), sqrt(2)); ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172,
    summed as an odd series to s^25 (the next term is below 2^-60 of the result). Measured within
    3 ulp of torch.log (tests/test_exact_math.py)."""
    m, e = torch.frexp(x)                            # m in [0.5, 1): exact
    small = m < 0.7071067811865476
    m = torch.where(small, m * 2, m)
    e = (e - small.to(e.dtype)).to(torch.float64)
    s = (m - 1) / (m + 1)
    s2 = s * s
    series = torch.full_like(s, 1.0 / 25)
    for k in range(23, 0, -2):                       # Horner, from the smallest term
        series = series * s2 + 1.0 / k
    return e * _LN2_HI + (e * _LN2_LO + 2 * s * series)


def sqrt_float64(x: Tensor) -> Tensor:
    """The square root of float64 `x` >= 0 (finite; other values give no promised result) from
    IEEE additions, multiplications, divisions and frexp, each its own kernel, so the same bits on
    every device and vector unit: torch.sqrt on a CPU tensor of more than a few elements is MKL's
    vector math, which is not correctly rounded (on an AMD EPYC one float64 root in 75 is an ulp
    off) and picks its code by the CPU's maker and vector unit (docs/adr/0021). Measured within an
    ulp of the correctly rounded root, and an ulp off it in about one root in four: Newton's last
    step lands on either neighbour (tests/test_exact_math.py).

    x = m 2^e with e even and 1/2 <= m < 2; sqrt m by five Newton steps from (1 + m) / 2 (6% off
    at worst, then 2e-3, 2e-6, 2e-12, 2e-24); times 2^(e/2), built from its bits (exact)."""
    m, e = torch.frexp(x)                           # m in [1/2, 1), exact
    odd = (e & 1) == 1
    m = torch.where(odd, m * 2.0, m)
    half_e = (e - odd.to(e.dtype)) // 2
    y = (m + 1.0) * 0.5
    for _ in range(5):
        y = (y + m / y) * 0.5
    scale = ((half_e.to(torch.int64) + 1023) << 52).view(torch.float64)      # 2^(e/2), a normal number
    return torch.where(x == 0, x, y * scale)


_TWO_PI = float(2 * _PI)
# Values per chunk of `normal`: its float64 temporaries stay near the cache (fastest here of 2^14..2^20).
NORMAL_CHUNK = 1 << 18


def normal(shape: tuple[int, ...] | torch.Size, generator: torch.Generator, scale: float = 1.0,
           dtype: torch.dtype = torch.float64) -> Tensor:
    """Normal draws of standard deviation `scale`, of `shape`, on the CPU, in `dtype` (each draw
    times `scale` in float64, rounded once), the same bits on every machine for one generator
    state. Pairs by Box-Muller: for uniforms (u1, u2) from torch.rand (a serial sampler, the same
    on every CPU), sqrt(-2 log(1 - u1)) times cos and sin of 2 pi u2, each computed by this
    module. Draws are made in chunks of NORMAL_CHUNK values (even), which gives the values of one
    draw: a tensor of n values takes n + n % 2 uniforms, and when n is odd its last pair's sine is
    dropped."""
    if NORMAL_CHUNK % 2:
        raise ValueError(f"NORMAL_CHUNK: expected an even number, got {NORMAL_CHUNK}")
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype)
    for start in range(0, n, NORMAL_CHUNK):
        size = min(NORMAL_CHUNK, n - start)
        u = torch.rand(-(-size // 2), 2, generator=generator, dtype=torch.float64)
        radius = sqrt_float64(log_float64(1.0 - u[:, 0]) * -2.0)
        cos, sin = cos_sin_float64(u[:, 1] * _TWO_PI)
        draws = torch.stack([radius * cos, radius * sin], dim=1).flatten()[:size]
        out[start:start + size] = draws if scale == 1.0 else draws * scale
    return out.view(shape)
