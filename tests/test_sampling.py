"""lockstep.sampling's noise: its logarithms are lockstep's own, so a draw does not follow the CPU's
vector unit (ATen picks AVX2 or AVX-512 kernels for torch.log at run time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lockstep.sampling import SamplingParams, draw, log_float64, uniform_noise

from test_cpu_kernels import ATEN_CAPABILITIES, require

DRAWS = """
import hashlib, json, torch
from lockstep import registry
from lockstep.sampling import SamplingParams, draw, log_float64, uniform_noise
u = uniform_noise(3, 11, 200_000)
noise = -log_float64(-log_float64(u))
logp = torch.log_softmax(torch.randn(50_000, generator=torch.Generator().manual_seed(0)), 0)
tokens = []
with registry.use_backend("portable"):
    for p in (SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.7, top_p=0.9, seed=6)):
        tokens += [draw(logp, p, position).token for position in range(40)]
print(json.dumps({"noise": hashlib.sha256(noise.numpy().tobytes()).hexdigest(), "tokens": tokens,
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def test_log_float64_is_within_3_ulp_of_torch_log():
    u = uniform_noise(1, 2, 300_000)
    x = torch.cat([u, -torch.log(u), torch.rand(50_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e3,
                   torch.tensor([1.0, 2.0, 0.5, 1e-300, 1e300, 5e-324, 1 - 2 ** -53, 1 + 2 ** -52], dtype=torch.float64)])
    ours, ref = log_float64(x).numpy(), torch.log(x).numpy()
    ulps = np.abs(ours - ref) / np.spacing(np.abs(ref)).clip(min=np.finfo(np.float64).tiny)
    assert ulps.max() <= 3, ulps.max()
    assert log_float64(torch.tensor([1.0], dtype=torch.float64)).item() == 0.0


def test_the_draws_do_not_follow_atens_vector_capability():
    """The Gumbel noise and the drawn tokens (plain and top-p, whose probabilities go through exp)
    in a process per ATen capability this CPU has: the same bits in each."""
    seen = []
    for name, flags in ATEN_CAPABILITIES.items():
        if flags - _flags():
            continue
        proc = subprocess.run([sys.executable, "-c", DRAWS], env={**os.environ, "ATEN_CPU_CAPABILITY": name},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert len({s["capability"] for s in seen}) == len(seen) >= 2, seen
    assert all(s["noise"] == seen[0]["noise"] and s["tokens"] == seen[0]["tokens"] for s in seen), seen


def _flags() -> set[str]:
    require(set())                      # x86-64 only: ATen's capabilities are its vector extensions there
    from test_cpu_kernels import cpu_flags

    return set(cpu_flags())


def test_a_draw_is_a_pure_function_of_its_row_and_seed():
    logp = torch.log_softmax(torch.randn(1000, generator=torch.Generator().manual_seed(1)), 0)
    p = SamplingParams(temperature=1.0, seed=9)
    assert [draw(logp, p, i).token for i in range(20)] == [draw(logp.clone(), p, i).token for i in range(20)]
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0).validate(1000)
