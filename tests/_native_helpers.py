"""Shared by the native backend's tests (tests/test_native_*.py): the instruction sets' CPU flags,
the dtypes, a fixture that forces an instruction set, the kernel set without its fused passes, fp32
FMA emulated exactly, bits with NaN as one, and the line a process without a compiler prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_cpu_kernels import require


ISA_FLAGS = {"scalar": set(), "avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl"},
             "avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def isa(monkeypatch):
    """Force an instruction set in this process (build.isa reads LOCKSTEP_CPU_ISA at every call).
    Tests loop over build.supported_isas(), so a CPU without some path (AVX512_BF16 on most Intel
    Xeons) compares the paths it has instead of skipping the test."""
    def force(name: str) -> None:
        require(ISA_FLAGS[name])
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", name)
    return force


@pytest.fixture(scope="module")
def unfused():
    """The native kernel set without its fused row reductions, split products and SiLU:
    fixed_order's PyTorch compositions on the native GEMMs, exp and log (a `kernels` argument)."""
    from lockstep.backends.native.cpu import KERNELS

    return KERNELS._replace(name="native-unfused", row_sum=None, log_softmax=None, log_softmax_backward=None,
                            lse_fold=None, logit_grad=None, split_matmul_rows=None, silu=None, silu_backward=None,
                            weight_grad_node=None)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma, emulated in float64: the product of two fp32 values is exact there."""
    return (c.double() + a.double() * b.double()).float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits, every NaN as one: torch.maximum's NaN has other bits in the vector body of its loop
    than in the scalar tail, so the composition's NaN payload follows a row's position."""
    t = torch.where(t.isnan(), torch.tensor(float("nan"), dtype=t.dtype), t)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def without_compiler(tmp_path: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: this process's environment) for a process without a working compiler:
    CC=/bin/false, nothing on PATH, and a kernel cache of its own under tmp_path."""
    return {**(os.environ if environ is None else environ), "CC": "/bin/false", "PATH": str(tmp_path),
            "LOCKSTEP_CACHE_DIR": str(tmp_path / "cache")}


def _fallback_lines(tmp_path: Path) -> list[str]:
    """The lines a process without a working compiler (`without_compiler`) prints about the native
    backend, on 2 threads."""
    code = ("import torch, lockstep\nfrom lockstep import ops, registry\ntorch.set_num_threads(2)\n"
            "x, w = torch.randn(3, 8), torch.randn(4, 8)\ny = ops.linear(x, w)\n"
            "with registry.use_backend('portable'):\n    assert torch.equal(y, ops.linear(x, w))\n"
            "print(registry.cpu_backend())\n")
    env = without_compiler(tmp_path)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "portable"
    return [line for line in proc.stderr.splitlines() if "native CPU backend" in line]


FALLBACK_LINE = ("lockstep: the native CPU backend is not in use (false could not compile kernels.c: (no message)); "
                 "running the portable backend, whose bits follow this machine's BLAS")
