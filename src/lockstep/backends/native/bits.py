"""The native kernels' bits as digests, and the recorded ones that every machine must give
(docs/adr/0026-the-bits-are-recorded.md).

`lockstep check` compares this machine's digests, on every instruction set it runs, with those in
recorded_bits.json, which were computed on the machine the file names; the test suite does too.
The digests need only Python, numpy and a build of kernels.c, no torch, so this file also runs as
a script where torch does not: under an emulator for another architecture (tests/test_native_bits.py
runs an aarch64 build under QEMU, in the user space that .ci/arm-sysroot makes).

Its inputs come from splitmix64 in numpy's uint64 arithmetic, as integers times powers of two (exact
in every dtype), bf16 bit patterns that reach every case of the bf16 order (denormals, products near
2^-126, Inf and NaN, as isa.c's self-test draws them), and special values written as bits; no
platform's floating-point library touches them. Before hashing, every NaN becomes one quiet NaN: the
contract counts any NaN equal to any other, and x86 and ARM produce NaNs of other signs. It covers
every kernel but the blocked transpose (a move): the GEMM (fp32, bf16 and fp16 operands, fp32 and
bf16 results, a bias, a batch, tails of every size, long K in blocks, K in parts) and a unit tree's
weight-gradient node in one call, exp and log, SiLU's four passes, rms_norm forward and backward (a
unit tree's partials), rope, the row sums, log_softmax forward and backward, the LM head's chunk
fold and logit gradient, and attention forward and backward over packed causal sequences (with and
without a window), under a mask, and its paged decode; each at sizes that run on several threads.

    python src/lockstep/backends/native/bits.py LIBRARY [ISA]
        ->   {"isa": "avx2", "digests": {"1": {"gemm": "...", ...}, ...}}
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

if __package__:
    from . import build
else:  # a script, maybe where torch is missing: build.py alone, whose top level is the standard library
    _spec = importlib.util.spec_from_file_location("_native_build", Path(__file__).with_name("build.py"))
    build = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(build)

RECORDED = Path(__file__).with_name("recorded_bits.json")

F32, BF16, F16 = 0, 1, 2
# Zeros of both signs, infinities, NaN, denormals, the largest finite, exp's overflow and underflow
# edges, 1 and the next float.
SPECIALS = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x807FFFFF,
                     0x00800000, 0x7F7FFFFF, 0x42B17218, 0xC2CFF1B5, 0x3F800000, 0x3F800001], dtype=np.uint32)


class Stream:
    """splitmix64 over a counter, in numpy's wrapping uint64 arithmetic: the same integers on every
    platform and numpy version (numpy's own generators promise no stream across releases)."""

    def __init__(self, seed: int):
        self.counter = np.uint64(seed)

    def bits(self, n: int) -> np.ndarray:
        """The stream's next n 64-bit integers (uint64)."""
        with np.errstate(over="ignore"):
            z = (self.counter + np.arange(1, n + 1, dtype=np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
            self.counter += np.uint64(n)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def integers(self, low: int, high: int, n: int) -> np.ndarray:
        """n integers in [low, high)."""
        return (self.bits(n) % np.uint64(high - low)).astype(np.int64) + low


def values(rng: Stream, n: int, dtype: int, scale: float = 1.0, specials: bool = False) -> np.ndarray:
    """n values of `dtype` (fp32 as float32, bf16 as its uint16 bits, fp16 as float16), each an
    integer times a power of two (every `scale` passed is one), so exact in that dtype on every
    platform; with `specials`, the first ones are SPECIALS (fp32 and bf16)."""
    if dtype == F32:
        x = (rng.integers(-2**20, 2**20, n) * (scale * 2.0**-20)).astype(np.float32)
    elif dtype == F16:
        x = (rng.integers(-2047, 2048, n) * (scale * 2.0**-10)).astype(np.float16)
    else:
        f = (rng.integers(-255, 256, n) * (scale * 2.0**-7)).astype(np.float32)
        x = (f.view(np.uint32) >> 16).astype(np.uint16)
    if specials:
        edge = SPECIALS[:n]
        x.view(np.uint32 if dtype == F32 else np.uint16)[:edge.size] = edge if dtype == F32 else edge >> 16
    return x


def bf16_edges(rng: Stream, n: int) -> np.ndarray:
    """n bf16 bit patterns as isa.c's VDPBF16PS self-test draws them: zeros and denormals, Inf
    and NaN, values whose products land near 2^-126, and ordinary ones."""
    kind, man, sign = rng.integers(0, 16, n), rng.integers(0, 128, n), rng.integers(0, 2, n) << 15
    e = np.where(kind == 0, 0, np.where(kind == 1, 255, np.where(kind < 6, 60 + rng.integers(0, 8, n),
                                                                  110 + rng.integers(0, 30, n))))
    return (sign | e << 7 | man).astype(np.uint16)


def canonical(out: np.ndarray) -> bytes:
    """out's bytes with every NaN as the one quiet NaN of its width (fp32, float64 or bf16 bits)."""
    if out.dtype == np.float32:
        bits = out.view(np.uint32).copy()
        bits[np.isnan(out)] = 0x7FC00000
    elif out.dtype == np.float64:
        bits = out.view(np.uint64).copy()
        bits[np.isnan(out)] = 0x7FF8000000000000
    else:
        bits = out.copy()
        bits[(bits & 0x7FFF) > 0x7F80] = 0x7FC0
    return bits.tobytes()


def ptr(a: np.ndarray | None) -> int | None:
    """The address of a's data, for a ctypes call (None stays NULL)."""
    return None if a is None else a.ctypes.data


class Run:
    """One pass over every op at one instruction set and thread count; each method named in OPS
    feeds what its kernels wrote to the hash `h` (hashlib.sha256) it is given."""

    def __init__(self, lib: ctypes.CDLL, isa: int, threads: int):
        self.lib, self.isa, self.threads, self.rng = lib, isa, threads, Stream(0)

    def check(self, status: int, what: str) -> None:
        """Raise if a kernel call `what` returned a nonzero status (a bad argument)."""
        if status != 0:
            raise RuntimeError(f"{what} returned {status}")

    def _gemm(self, h, a, b, batch, m, n, k, dt, out_dt=F32, bias=None, parts=1) -> None:
        out = np.zeros(batch * m * n, dtype=np.float32 if out_dt == F32 else np.uint16)
        self.check(self.lib.ls_gemm_nt(batch, m, n, k, ptr(a), k, m * k, ptr(b), k, n * k, ptr(out), n, m * n,
                                       ptr(bias), dt, out_dt, parts, self.isa, self.threads), "ls_gemm_nt")
        h.update(canonical(out))

    def gemm(self, h) -> None:
        for dt in (F32, BF16, F16):
            for (batch, m, n, k), bias, out_dt in [((1, 1, 7, 5), False, F32), ((1, 3, 20, 33), True, F32),
                                                   ((1, 17, 35, 100), False, F32), ((2, 9, 16, 64), False, F32),
                                                   ((1, 130, 300, 96), True, F32), ((1, 9, 40, 4200), False, F32),
                                                   ((1, 5, 40, 129), False, BF16)]:
                if out_dt == BF16 and dt != BF16:
                    continue
                a = values(self.rng, batch * m * k, dt, specials=m == 17 and dt != F16)
                b = values(self.rng, batch * n * k, dt)
                self._gemm(h, a, b, batch, m, n, k, dt, out_dt, values(self.rng, n, F32) if bias else None)
        for dt, parts in ((F32, 4), (BF16, 2)):  # K in parts, combined by the canonical tree
            self._gemm(h, values(self.rng, 6 * 512, dt), values(self.rng, 50 * 512, dt), 1, 6, 50, 512, dt, dt,
                       parts=parts)
        for m, n, k in ((9, 35, 103), (64, 70, 300), (5, 8, 4200)):  # every case of the bf16 order
            a, b = bf16_edges(self.rng, m * k), bf16_edges(self.rng, n * k)
            for out_dt in (F32, BF16):
                self._gemm(h, a, b, 1, m, n, k, BF16, out_dt)

    def gemm_tree(self, h) -> None:
        """A weight gradient's tree node over four units (rows of K) in one call."""
        bounds = np.array([0, 128, 256, 320, 448], dtype=np.int64)
        for dt in (F32, BF16, F16):
            m, n, k = 130, 96, int(bounds[-1])
            a, b = values(self.rng, m * k, dt, specials=dt != F16), values(self.rng, n * k, dt)
            out = np.zeros(m * n, dtype=np.float32)
            self.check(self.lib.ls_gemm_nt_tree(m, n, k, ptr(a), k, ptr(b), k, ptr(out), n, bounds.size - 1,
                                                ptr(bounds), dt, self.isa, self.threads), "ls_gemm_nt_tree")
            h.update(canonical(out))

    def unary(self, h) -> None:
        x = np.concatenate([SPECIALS.view(np.float32), values(self.rng, 40000, F32, 256.0),
                            np.abs(values(self.rng, 40000, F32, 2.0**60))])
        for fn in (0, 1):
            y = np.zeros_like(x)
            self.check(self.lib.ls_unary(ptr(x), ptr(y), x.size, fn, self.isa, self.threads), "ls_unary")
            h.update(canonical(y))

    def _float64_values(self, n: int) -> np.ndarray:
        """n float64 values with full 53-bit significands in [2^-8, 2^9), signs mixed: their products
        round, so an FMA, a plain multiply-add or another order would give other sums."""
        significand = self.rng.integers(2**52, 2**53, n).astype(np.float64) * 2.0**-52
        sign = np.where(self.rng.integers(0, 2, n) == 1, -1.0, 1.0)
        return sign * np.ldexp(significand, self.rng.integers(-8, 9, n).astype(np.int32))

    def float64(self, h) -> None:
        """ls_gemm_nt_f64 (a tail in every lane width, a bias, a batch) and ls_unary_f64's exp, log and
        sqrt over fp32's SPECIALS widened, ordinary values and the float64 range."""
        for batch, m, n, k in ((1, 37, 19, 1029), (2, 5, 7, 45)):
            a = self._float64_values(batch * m * k)
            b = self._float64_values(batch * n * k)
            bias = self._float64_values(n)
            out = np.zeros(batch * m * n, dtype=np.float64)
            self.check(self.lib.ls_gemm_nt_f64(batch, m, n, k, ptr(a), k, m * k, ptr(b), k, n * k, ptr(out), n, m * n,
                                               ptr(bias), self.isa, self.threads), "ls_gemm_nt_f64")
            h.update(canonical(out))
        wide = (self.rng.integers(1, 2**62, 40000).astype(np.uint64) * np.uint64(2) - np.uint64(1)).view(np.float64)
        x = np.concatenate([SPECIALS.view(np.float32).astype(np.float64), values(self.rng, 40000, F32, 1024.0)
                            .astype(np.float64), np.abs(wide[np.isfinite(wide)])])
        for fn in (0, 1, 2):
            y = np.zeros_like(x)
            self.check(self.lib.ls_unary_f64(ptr(x), ptr(y), x.size, fn, self.isa, self.threads), "ls_unary_f64")
            h.update(canonical(y))

    def silu(self, h) -> None:
        for dt in (F32, BF16):
            n = 40000
            gate, up, dy = (values(self.rng, n, dt, 8.0, specials=True) for _ in range(3))
            for mode in range(4):
                out, out_up = np.zeros_like(gate), np.zeros_like(gate)
                self.check(self.lib.ls_silu(n, ptr(gate), ptr(up), ptr(dy), ptr(out), ptr(out_up), dt, mode, self.isa,
                                            self.threads), "ls_silu")
                h.update(canonical(out) + (canonical(out_up) if mode == 1 else b""))

    def rms_norm(self, h) -> None:
        for dt in (F32, BF16):
            rows, hidden = 70, 1000
            x, w = values(self.rng, rows * hidden, dt, 4.0, specials=True), values(self.rng, hidden, F32)
            y = np.zeros(rows * hidden, dtype=np.float32 if dt == F32 else np.uint16)
            rstd = np.zeros(rows, dtype=np.float32)
            self.check(self.lib.ls_rms_norm_fwd(rows, hidden, ptr(x), ptr(w), 1e-6, 0.0, ptr(y), ptr(rstd), dt, F32, dt,
                                                self.isa, self.threads), "ls_rms_norm_fwd")
            h.update(canonical(y) + canonical(rstd))
            # The backward: d x, and the weight's gradient as three units' partials (a unit tree's).
            g = values(self.rng, rows * hidden, dt)
            dx = np.zeros_like(y)
            units = np.array([0, 20, 20, rows], dtype=np.int64)
            dw = np.zeros(3 * hidden, dtype=np.float32)
            self.check(self.lib.ls_rms_norm_bwd(rows, hidden, ptr(x), ptr(w), ptr(g), ptr(rstd), 0.0, ptr(dx), ptr(dw),
                                                ptr(units), 3, 1, dt, F32, dt, dt, self.isa, self.threads),
                       "ls_rms_norm_bwd")
            h.update(canonical(dx) + canonical(dw))

    def rope(self, h) -> None:
        for dt in (F32, BF16):
            t, heads, d = 70, 4, 128
            x = values(self.rng, t * heads * d, dt, 4.0, specials=True)
            cos, sin = values(self.rng, t * d // 2, F32), values(self.rng, t * d // 2, F32)
            for interleaved in (0, 1):
                y = np.zeros_like(x)
                self.check(self.lib.ls_rope(t, heads, d, ptr(x), ptr(cos), ptr(sin), ptr(y), dt, interleaved, self.isa,
                                            self.threads), "ls_rope")
                h.update(canonical(y))

    def rows(self, h) -> None:
        rows, length = 19, 4200
        x = values(self.rng, rows * length, F32, 32.0, specials=True)
        total = np.zeros(rows, dtype=np.float32)
        self.check(self.lib.ls_rows(rows, length, ptr(x), None, ptr(total), 0, self.isa, self.threads), "ls_rows")
        y = np.zeros_like(x)
        self.check(self.lib.ls_rows(rows, length, ptr(x), None, ptr(y), 1, self.isa, self.threads), "ls_rows")
        g, dx = values(self.rng, rows * length, F32), np.zeros_like(x)
        self.check(self.lib.ls_rows(rows, length, ptr(g), ptr(y), ptr(dx), 2, self.isa, self.threads), "ls_rows")
        h.update(canonical(total) + canonical(y) + canonical(dx))

    def logit_rows(self, h) -> None:
        """The LM head's chunk kernels: two chunks folded into a running max and sum, one call each,
        and again as one call's two pieces, which must agree; then the logits' gradient of a chunk."""
        rows, length = 19, 4200
        for dt, out_dt in ((F32, F32), (BF16, BF16), (F16, F32)):
            run_max, run_sum = np.zeros(rows, dtype=np.float32), np.zeros(rows, dtype=np.float32)
            pieces = []
            for first in (1, 0):
                x = values(self.rng, rows * length, dt, 16.0, specials=first == 1 and dt != F16)
                pieces.append(x.reshape(rows, length))
                self.check(self.lib.ls_logit_rows(rows, length, length, ptr(x), length, dt, 0.75, 0, first,
                                                  ptr(run_max), ptr(run_sum), None, None, None, None, None, 0,
                                                  self.isa, self.threads), "ls_logit_rows (fold)")
            both = np.ascontiguousarray(np.concatenate(pieces, axis=1))
            one_max, one_sum = np.zeros(rows, dtype=np.float32), np.zeros(rows, dtype=np.float32)
            self.check(self.lib.ls_logit_rows(rows, 2 * length, length, ptr(both), 2 * length, dt, 0.75, 0, 1,
                                              ptr(one_max), ptr(one_sum), None, None, None, None, None, 0, self.isa,
                                              self.threads), "ls_logit_rows (fold in pieces)")
            if canonical(one_max) + canonical(one_sum) != canonical(run_max) + canonical(run_sum):
                raise RuntimeError("ls_logit_rows: a fold in pieces gave other bits than a call per piece")
            h.update(canonical(run_max) + canonical(run_sum))
            lse, gs = values(self.rng, rows, F32, 16.0), values(self.rng, rows, F32)
            local = self.rng.integers(0, length, rows)
            inside = self.rng.integers(0, 2, rows).astype(np.float32)
            out = np.zeros(rows * length, dtype=np.float32 if out_dt == F32 else np.uint16)
            self.check(self.lib.ls_logit_rows(rows, length, length, ptr(x), length, dt, 0.75, 1, 0, None, None,
                                              ptr(lse), ptr(local), ptr(inside), ptr(gs), ptr(out), out_dt, self.isa,
                                              self.threads), "ls_logit_rows (gradient)")
            h.update(canonical(out))

    def masked_attention(self, h) -> None:
        """Attention under an explicit mask (the batch-invariant mode's), keys [B, Hkv, Lk, D] read in
        place: left padding and causality, forward and backward."""
        batch, lq, lk, hq, hkv, d = 2, 48, 48, 4, 2, 40
        pad = [5, 0]
        mask = np.zeros((batch * lq, lk), dtype=np.uint8)
        for b in range(batch):
            for i in range(lq):
                mask[b * lq + i, pad[b]:i + 1] = 1
        cu = np.arange(0, batch * lq + 1, lq, dtype=np.int64)
        len_k = np.full(batch, lk, dtype=np.int64)
        starts = np.arange(batch, dtype=np.int64) * hkv * lk * d
        for dt in (F32, BF16, F16):
            q = values(self.rng, batch * lq * hq * d, dt, 2.0)
            k, v = (values(self.rng, batch * hkv * lk * d, dt, 2.0) for _ in range(2))
            out, row_max, row_sum = (np.zeros(n, dtype=np.float32) for n in (batch * lq * hq * d, batch * lq * hq,
                                                                              batch * lq * hq))
            self.check(self.lib.ls_attention_fwd(batch, hq, hkv, d, ptr(q), ptr(k), ptr(v), d, lk * d, ptr(cu),
                                                 ptr(len_k), ptr(starts), None, 0, 0, ptr(mask), lk, 0.125, 0, 0,
                                                 ptr(out), ptr(row_max), ptr(row_sum), dt, self.isa, self.threads),
                       "ls_attention_fwd (masked)")
            h.update(canonical(out) + canonical(row_max) + canonical(row_sum))
            dout, delta = values(self.rng, batch * lq * hq * d, dt), np.zeros(batch * lq * hq, dtype=np.float32)
            dq, dk, dv = (np.zeros(n, dtype=np.float32) for n in (q.size, k.size, v.size))
            self.check(self.lib.ls_attention_bwd(batch, hq, hkv, d, ptr(q), ptr(k), ptr(v), ptr(dout), d, lk * d,
                                                 ptr(cu), ptr(len_k), ptr(starts), ptr(mask), lk, 0.125, 0, 0,
                                                 ptr(row_max), ptr(row_sum), ptr(delta), ptr(dq), ptr(dk), ptr(dv),
                                                 dt, self.isa, self.threads), "ls_attention_bwd (masked)")
            h.update(canonical(dq) + canonical(dk) + canonical(dv))

    def attention(self, h) -> None:
        lens, hq, hkv, d = [20, 1, 90], 4, 2, 40
        cu = np.array([0, *np.cumsum(lens)], dtype=np.int64)
        starts = cu[:-1] * hkv * d
        len_k = np.array(lens, dtype=np.int64)
        t = int(cu[-1])
        for dt in (F32, BF16, F16):
            q = values(self.rng, t * hq * d, dt, 2.0, specials=dt != F16)
            k, v = (values(self.rng, t * hkv * d, dt, 2.0) for _ in range(2))
            for window in (0, 16):
                out, row_max, row_sum = (np.zeros(n, dtype=np.float32) for n in (t * hq * d, t * hq, t * hq))
                # A scale of 2^-3, exact, not d^-0.5: pow is not correctly rounded in every C library.
                self.check(self.lib.ls_attention_fwd(len(lens), hq, hkv, d, ptr(q), ptr(k), ptr(v), hkv * d, d,
                                                     ptr(cu), ptr(len_k), ptr(starts), None, 0, 0, None, 0, 0.125, 1,
                                                     window, ptr(out), ptr(row_max), ptr(row_sum), dt, self.isa,
                                                     self.threads), "ls_attention_fwd")
                h.update(canonical(out) + canonical(row_max) + canonical(row_sum))
                dout, delta = values(self.rng, t * hq * d, dt), np.zeros(t * hq, dtype=np.float32)
                dq, dk, dv = (np.zeros(n, dtype=np.float32) for n in (t * hq * d, t * hkv * d, t * hkv * d))
                self.check(self.lib.ls_attention_bwd(len(lens), hq, hkv, d, ptr(q), ptr(k), ptr(v), ptr(dout), hkv * d,
                                                     d, ptr(cu), ptr(len_k), ptr(starts), None, 0, 0.125, 1, window,
                                                     ptr(row_max), ptr(row_sum), ptr(delta), ptr(dq), ptr(dk), ptr(dv),
                                                     dt, self.isa, self.threads), "ls_attention_bwd")
                h.update(canonical(dq) + canonical(dk) + canonical(dv))
            # Paged decode: one query per sequence, its keys in 16-row blocks of a cache, the blocks
            # listed in reverse order in the table.
            block, blocks = 16, [(n + 15) // 16 for n in lens]
            table = np.zeros((len(lens), max(blocks)), dtype=np.int64)
            free = list(range(sum(blocks)))[::-1]
            for b, used in enumerate(blocks):
                table[b, :used] = [free.pop() for _ in range(used)][::-1]
            cache_k, cache_v = (values(self.rng, sum(blocks) * block * hkv * d, dt, 2.0) for _ in range(2))
            q1 = values(self.rng, len(lens) * hq * d, dt, 2.0)
            cu1 = np.arange(len(lens) + 1, dtype=np.int64)
            out, row_max, row_sum = (np.zeros(n, dtype=np.float32) for n in (len(lens) * hq * d, len(lens) * hq,
                                                                              len(lens) * hq))
            self.check(self.lib.ls_attention_fwd(len(lens), hq, hkv, d, ptr(q1), ptr(cache_k), ptr(cache_v), hkv * d, d,
                                                 ptr(cu1), ptr(len_k), None, ptr(table), table.shape[1], block, None,
                                                 0, 0.125, 1, 0, ptr(out), ptr(row_max), ptr(row_sum), dt, self.isa,
                                                 self.threads), "ls_attention_fwd (paged)")
            h.update(canonical(out) + canonical(row_max) + canonical(row_sum))


OPS = ("gemm", "gemm_tree", "unary", "silu", "rms_norm", "rope", "rows", "logit_rows", "attention", "masked_attention",
       "float64")


def digests(lib: ctypes.CDLL, isa: int, threads: int) -> dict[str, str]:
    """{kernel group (OPS): sha256 hex} of one pass at instruction set `isa` (build.ISAS' code) on
    `threads` threads."""
    run, out = Run(lib, isa, threads), {}
    for name in OPS:
        h = hashlib.sha256()
        getattr(run, name)(h)
        out[name] = h.hexdigest()
    return out


def recorded() -> dict:
    """recorded_bits.json: "kernels" ({kernel group: digest}), "native_backend" ({section: digest},
    lockstep.tools.backend_bits), "torch" (the releases found to give those bits) and
    "recorded_on" (machine, isa, compiler, ...)."""
    try:
        data = json.loads(RECORDED.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{RECORDED}: cannot read the recorded bits ({e}); reinstall lockstep") from None
    keys = ("kernels", "native_backend", "recorded_on", "torch")
    missing = [key for key in keys if not isinstance(data, dict) or key not in data]
    if missing:
        problem = "it lacks " + ", ".join(missing)
    elif not isinstance(data["recorded_on"], dict) or not {"machine", "isa"} <= data["recorded_on"].keys():
        problem = "recorded_on lacks machine or isa"
    elif not all(isinstance(data[key], dict) for key in ("kernels", "native_backend")):
        problem = "kernels or native_backend is not an object of digests"
    elif not isinstance(data["torch"], list) or not all(isinstance(r, str) for r in data["torch"]):
        problem = "torch is not a list of releases"
    else:
        return data
    raise ValueError(f"{RECORDED}: expected a JSON object with \"kernels\", \"native_backend\", \"recorded_on\" "
                     f"(machine, isa) and \"torch\" (a list of releases); {problem}; reinstall lockstep")


def differing(got: dict[str, str], want: dict[str, str]) -> list[str]:
    """The names whose digest in `got` is not the one in `want` (or is in only one of them), sorted."""
    return sorted(name for name in want.keys() | got.keys() if got.get(name) != want.get(name))


def compare(want: dict[str, str], threads: int = 2) -> dict[str, list[str]]:
    """{instruction set: the kernel groups whose bits are not `want`'s} for every instruction set this
    CPU and build run; an empty list where all agree. 2 threads by default: the recording ran on 1,
    so the comparison also covers the split of outputs between threads."""
    return {name: differing(digests(build.library(), build.ISAS[name], threads), want)
            for name in build.supported_isas()}


def describe(differ: dict[str, list[str]]) -> str:
    """'avx2: gemm, rope; avx512: rope' for {where: names}, leaving out empty lists."""
    return "; ".join(f"{key}: {', '.join(names)}" for key, names in differ.items() if names)


def mismatch(what: str, differ: dict[str, list[str]], on: dict) -> str:
    """The message for `what` giving other bits than those recorded on `on` (recorded()["recorded_on"]),
    in differ's {where: names}."""
    return (f"{what} gave other bits than those recorded on {on['machine']} ({on['isa']}), in {describe(differ)}. "
            f"If you changed lockstep's arithmetic on purpose, record the new bits (python "
            f"tests/_native_digest.py --record, in a clone) and say why in the commit. If not, this machine breaks "
            f"the contract's promise of one set of bits on every CPU (docs/contract.md section 7, docs/adr/0026): "
            f"please open an issue on lockstep with this message and `lockstep check`'s first line")


def main() -> int:
    """The script: every kernel group's digest on 1, 2 and 3 threads, as JSON on one line."""
    if len(sys.argv) not in (2, 3):
        raise SystemExit(f"usage: python {sys.argv[0]} LIBRARY [ISA] (LIBRARY: a build of kernels.c; ISA: one of "
                         f"{list(build.ISAS)}, by default the widest this CPU runs)")
    lib = build.declare(ctypes.CDLL(sys.argv[1]))
    lib.ls_use_openmp(None)  # the library's own threads: no torch, so no OpenMP runtime of its
    supported = [name for name, code in build.ISAS.items() if lib.ls_cpu_supports(code)]
    isa = sys.argv[2] if len(sys.argv) > 2 else supported[-1]
    if isa not in supported:
        raise SystemExit(f"ISA: this CPU and build run {supported}, not {isa!r}")
    print(json.dumps({"isa": isa, "digests": {str(t): digests(lib, build.ISAS[isa], t) for t in (1, 2, 3)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
