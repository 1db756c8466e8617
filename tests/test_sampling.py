"""lockstep.sampling does not follow the CPU's vector unit: the Gumbel noise's logarithms are
lockstep's own, and top-p's probabilities use the CPU backend's exp.

PyTorch picks its exp and log kernels at run time: ATen's by capability, MKL's vector math by
instruction set, and MKL's fp32 exp and log bits follow it on Intel CPUs (ADR 0010). On the AMD
EPYC this was written on, stock float64 log and float32 exp of log-probabilities gave the same bits
under every selection, so there this test passes with stock kernels too; it bites where they differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lockstep.sampling import SamplingParams, draw

from test_cpu_kernels import ATEN_CAPABILITIES, MKL_ISAS, cpu_flags, require

DRAWS = """
import hashlib, json, torch
from lockstep import ops
from lockstep.numerics.exact_math import log_float64
from lockstep.sampling import SamplingParams, draw, probabilities, uniform_noise
digest = lambda t: hashlib.sha256(t.numpy().tobytes()).hexdigest()
u = uniform_noise(3, 11, 200_000)
# inputs from integer hashing (torch.randn's Box-Muller follows the capability) and ops.log_softmax
logp = ops.log_softmax(((uniform_noise(1, 2, 50_000) - 0.5) * 40).float())
tokens = []
for p in (SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.7, top_p=0.9, seed=6)):
    tokens += [draw(logp, p, position).token for position in range(40)]
print(json.dumps({"noise": digest(-log_float64(-log_float64(u))), "tokens": tokens,
                  "top_p_probabilities": digest(probabilities(logp, torch.isfinite(logp))),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def test_the_draws_do_not_follow_atens_vector_capability():
    """The Gumbel noise, top-p's probabilities and the drawn tokens (plain and top-p) in a process
    per ATen capability and per MKL instruction set this CPU has: the same bits in each."""
    require(set())                      # x86-64: these selections are its vector extensions
    envs = [("ATEN_CPU_CAPABILITY", name) for name, flags in ATEN_CAPABILITIES.items() if flags <= cpu_flags()]
    envs += [("MKL_ENABLE_INSTRUCTIONS", name) for name, flags in MKL_ISAS.items() if flags <= cpu_flags()]
    seen = []
    for key, value in envs:
        proc = subprocess.run([sys.executable, "-c", DRAWS], env={**os.environ, key: value},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert len({s["capability"] for s in seen}) >= 2, seen
    for key in ("noise", "top_p_probabilities", "tokens"):
        assert all(s[key] == seen[0][key] for s in seen), (key, seen)


def test_a_draw_is_a_pure_function_of_its_row_and_seed():
    logp = torch.log_softmax(torch.randn(1000, generator=torch.Generator().manual_seed(1)), 0)
    p = SamplingParams(temperature=1.0, seed=9)
    assert [draw(logp, p, i).token for i in range(20)] == [draw(logp.clone(), p, i).token for i in range(20)]
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0).validate(1000)
