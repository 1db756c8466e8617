"""Digests of the native kernels' outputs without torch: numpy buffers and ctypes calls only.

The torch-based digest (_native_digest.py) needs torch on the machine that runs it. This one needs
only Python, numpy and a build of kernels.c, so it runs where torch does not: under an emulator
for another architecture (.ci/arm runs an aarch64 build under QEMU), and it ties the bits there to
the x86 paths' (tests/test_native.py runs it on every instruction set and thread count here).

Its inputs are integers from numpy's PCG64 scaled by powers of two, exact in every dtype, so no
platform's floating-point library touches them; special values (zeros of both signs, infinities,
NaN, denormals) are written as bits. It covers the GEMM (fp32, bf16 and fp16 operands, fp32 and
bf16 results, a bias, a batch, tails of every size), exp and log, SiLU's four passes, rms_norm's
forward, rope, the row sums and log_softmax forward and backward, and attention's forward over
packed causal sequences.

    python tests/_native_bits.py LIBRARY [ISA]   ->   {"isa": "avx2", "digests": {"1": {"gemm": "...", ...}, ...}}
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "_native_build", Path(__file__).resolve().parent.parent / "src/lockstep/backends/native/build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)  # build.py's top level is the standard library alone

F32, BF16, F16 = 0, 1, 2
SPECIALS = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x807FFFFF,
                     0x00800000, 0x7F7FFFFF, 0x42B17218, 0xC2CFF1B5, 0x3F800000, 0x3F800001], dtype=np.uint32)


def values(rng: np.random.Generator, n: int, dtype: int, scale: float = 1.0) -> np.ndarray:
    """n values of `dtype` (fp32 as float32, bf16 as its uint16 bits, fp16 as float16), each an
    integer times a power of two, so exact in that dtype on every platform."""
    if dtype == F32:
        return (rng.integers(-2**20, 2**20, n) * (scale * 2.0**-20)).astype(np.float32)
    if dtype == F16:
        return (rng.integers(-2047, 2048, n) * (scale * 2.0**-10)).astype(np.float16)
    f = (rng.integers(-255, 256, n) * (scale * 2.0**-7)).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def as_f32(x: np.ndarray) -> np.ndarray:
    """bf16 bits or float16 or float32, widened exactly to float32."""
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


class Run:
    def __init__(self, lib: ctypes.CDLL, isa: int, threads: int):
        self.lib, self.isa, self.threads, self.rng = lib, isa, threads, np.random.Generator(np.random.PCG64(0))

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned {status}")

    def gemm(self, h) -> None:
        for dt in (F32, BF16, F16):
            for (batch, m, n, k), bias, out_dt in [((1, 1, 7, 5), False, F32), ((1, 3, 20, 33), True, F32),
                                                   ((1, 17, 35, 100), False, F32), ((2, 9, 16, 64), False, F32),
                                                   ((1, 64, 70, 300), True, F32), ((1, 5, 40, 129), False, BF16)]:
                if out_dt == BF16 and dt != BF16:
                    continue
                a, b = values(self.rng, batch * m * k, dt), values(self.rng, batch * n * k, dt)
                out = np.zeros(batch * m * n, dtype=np.float32 if out_dt == F32 else np.uint16)
                bias_v = values(self.rng, n, F32) if bias else None
                self.check(self.lib.ls_gemm_nt(batch, m, n, k, ptr(a), k, m * k, ptr(b), k, n * k, ptr(out), n,
                                               m * n, ptr(bias_v), dt, out_dt, 1, self.isa, self.threads), "ls_gemm_nt")
                h.update(out.tobytes())

    def unary(self, h) -> None:
        x = np.concatenate([SPECIALS.view(np.float32), values(self.rng, 3000, F32, 200.0),
                            np.abs(values(self.rng, 3000, F32, 2.0**60))])
        for fn in (0, 1):
            y = np.zeros_like(x)
            self.check(self.lib.ls_unary(ptr(x), ptr(y), x.size, fn, self.isa, self.threads), "ls_unary")
            h.update(y.tobytes())

    def silu(self, h) -> None:
        for dt in (F32, BF16):
            n = 5000
            gate, up, dy = (values(self.rng, n, dt, 8.0) for _ in range(3))
            for mode in range(4):
                out, out_up = np.zeros_like(gate), np.zeros_like(gate)
                self.check(self.lib.ls_silu(n, ptr(gate), ptr(up), ptr(dy), ptr(out), ptr(out_up), dt, mode, self.isa,
                                            self.threads), "ls_silu")
                h.update(out.tobytes() + (out_up.tobytes() if mode == 1 else b""))

    def rms_norm(self, h) -> None:
        for dt in (F32, BF16):
            rows, hidden = 13, 264
            x, w = values(self.rng, rows * hidden, dt, 4.0), values(self.rng, hidden, F32)
            y = np.zeros(rows * hidden, dtype=np.float32 if dt == F32 else np.uint16)
            rstd = np.zeros(rows, dtype=np.float32)
            self.check(self.lib.ls_rms_norm_fwd(rows, hidden, ptr(x), ptr(w), 1e-6, 0.0, ptr(y), ptr(rstd), dt, F32, dt,
                                                self.isa, self.threads), "ls_rms_norm_fwd")
            h.update(y.tobytes() + rstd.tobytes())

    def rope(self, h) -> None:
        for dt in (F32, BF16):
            t, heads, d = 11, 3, 40
            x = values(self.rng, t * heads * d, dt, 4.0)
            cos, sin = values(self.rng, t * d // 2, F32), values(self.rng, t * d // 2, F32)
            for interleaved in (0, 1):
                y = np.zeros_like(x)
                self.check(self.lib.ls_rope(t, heads, d, ptr(x), ptr(cos), ptr(sin), ptr(y), dt, interleaved, self.isa,
                                            self.threads), "ls_rope")
                h.update(y.tobytes())

    def rows(self, h) -> None:
        rows, length = 7, 4200
        x = values(self.rng, rows * length, F32, 30.0)
        total = np.zeros(rows, dtype=np.float32)
        self.check(self.lib.ls_rows(rows, length, ptr(x), None, ptr(total), 0, self.isa, self.threads), "ls_rows")
        y = np.zeros_like(x)
        self.check(self.lib.ls_rows(rows, length, ptr(x), None, ptr(y), 1, self.isa, self.threads), "ls_rows")
        g, dx = values(self.rng, rows * length, F32), np.zeros_like(x)
        self.check(self.lib.ls_rows(rows, length, ptr(g), ptr(y), ptr(dx), 2, self.isa, self.threads), "ls_rows")
        h.update(total.tobytes() + y.tobytes() + dx.tobytes())

    def attention(self, h) -> None:
        lens, hq, hkv, d = [20, 1, 90], 4, 2, 40
        cu = np.array([0, *np.cumsum(lens)], dtype=np.int64)
        starts = cu[:-1] * hkv * d
        len_k = np.array(lens, dtype=np.int64)
        t = int(cu[-1])
        for dt in (F32, BF16, F16):
            q = values(self.rng, t * hq * d, dt, 2.0)
            k, v = (values(self.rng, t * hkv * d, dt, 2.0) for _ in range(2))
            out, row_max, row_sum = (np.zeros(n, dtype=np.float32) for n in (t * hq * d, t * hq, t * hq))
            # A scale of 2^-3, exact, not d^-0.5: pow is not correctly rounded in every C library.
            self.check(self.lib.ls_attention_fwd(len(lens), hq, hkv, d, ptr(q), ptr(k), ptr(v), hkv * d, d, ptr(cu),
                                                 ptr(len_k), ptr(starts), None, 0, 0, None, 0, 0.125, 1, 0, ptr(out),
                                                 ptr(row_max), ptr(row_sum), dt, self.isa, self.threads),
                       "ls_attention_fwd")
            h.update(out.tobytes() + row_max.tobytes() + row_sum.tobytes())


OPS = ("gemm", "unary", "silu", "rms_norm", "rope", "rows", "attention")


def digests(lib: ctypes.CDLL, isa: int, threads: int) -> dict[str, str]:
    run, out = Run(lib, isa, threads), {}
    for name in OPS:
        h = hashlib.sha256()
        getattr(run, name)(h)
        out[name] = h.hexdigest()
    return out


def main() -> int:
    lib = build.declare(ctypes.CDLL(sys.argv[1]))
    lib.ls_use_openmp(None)  # the library's own threads: no torch, so no OpenMP runtime of its
    supported = [name for name, code in build.ISAS.items() if lib.ls_cpu_supports(code)]
    isa = sys.argv[2] if len(sys.argv) > 2 else supported[-1]
    if isa not in supported:
        raise SystemExit(f"this CPU and build run {supported}, not {isa!r}")
    print(json.dumps({"isa": isa, "digests": {str(t): digests(lib, build.ISAS[isa], t) for t in (1, 2, 3)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
