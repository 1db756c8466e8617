"""lockstep.sampling does not follow the CPU's vector unit: the Gumbel noise's logarithms are
lockstep's own, and top-p's probabilities use the CPU backend's exp.

PyTorch picks its exp and log kernels at run time: ATen's by capability, MKL's vector math by
instruction set, and MKL's fp32 exp and log bits follow it on Intel CPUs (ADR 0010). On the AMD
EPYC this was written on, stock float64 log and float32 exp of log-probabilities gave the same bits
under every selection, so there this test passes with stock kernels too; it bites where they differ."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from lockstep import ops
from lockstep.sampling import Draw, SamplingParams, draw, draw_rows, sample, uniform_noise
from lockstep.tools.host_work import HostWork

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


def _hashed(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """float32 values in (-scale/2, scale/2) from integer hashing: the same on every machine."""
    return ((uniform_noise(seed, 0, math.prod(shape)) - 0.5) * scale).float().reshape(shape)


MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, seed=1, logprobs=5),
         SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01, seed=2, repetition_penalty=1.2),
         SamplingParams(temperature=0.0, repetition_penalty=1.3, top_k=4, logprobs=2),
         SamplingParams(temperature=1.0, seed=3, min_p=0.2),
         SamplingParams(temperature=0.8, top_p=0.5, seed=4, logprobs=20, repetition_penalty=0.7)]


def _step(n: int = len(MIXED), vocab: int = 1000, width: int = 32):
    hidden = _hashed(1, (n, width), 4.0)
    lm_head = _hashed(2, (vocab, width), 2.0)
    seen = [uniform_noise(10 + i, 0, vocab) < 0.05 if i % 3 else None for i in range(n)]
    return hidden, lm_head, seen


def _bits(d: Draw) -> tuple:
    return d.token, float(d.logprob).hex(), [(t, float(v).hex()) for t, v in d.top]


def test_a_step_draws_each_row_as_draw_does_and_as_alone_in_any_order():
    """`sample` over rows of mixed parameters gives, bit for bit, what `draw` gives on each row's
    log-probabilities, and what the row gives sampled alone or among the rows in another order."""
    hidden, lm_head, seen = _step()
    params, positions, streams = MIXED, [5, 6, 7, 2**33, 9, 10], [0, 1, 0, 2, 0, 3]
    drawn = [_bits(d) for d in sample(hidden, lm_head, params, positions, streams, seen)]
    by_draw = []
    for i, p in enumerate(params):
        logp = ops.vocab_logprobs(hidden[i:i + 1], lm_head, temperature=p.report_temperature)[0]
        by_draw.append(_bits(draw(logp, p, positions[i], streams[i], seen[i])))
    assert drawn == by_draw
    alone = [_bits(sample(hidden[i:i + 1], lm_head, [p], positions[i:i + 1], streams[i:i + 1], seen[i:i + 1])[0])
             for i, p in enumerate(params)]
    assert drawn == alone
    order = [4, 1, 5, 0, 3, 2]
    shuffled = sample(hidden[order], lm_head, [params[i] for i in order], [positions[i] for i in order],
                      [streams[i] for i in order], [seen[i] for i in order])
    assert [_bits(shuffled[order.index(i)]) for i in range(len(params))] == drawn
    assert len({d[0] for d in drawn}) > 1 and all(len(d[2]) == p.logprobs for d, p in zip(drawn, params))


def test_a_step_reads_tensor_data_twice_and_a_nan_row_stays_its_own():
    """Six rows of mixed parameters come back in two reads of tensor data (on a GPU each read waits
    for the device); a row whose hidden state is NaN gets a non-finite logprob, the others their own."""
    hidden, lm_head, seen = _step()
    positions = list(range(len(MIXED)))
    with HostWork() as work:
        clean = sample(hidden, lm_head, MIXED, positions, None, seen)
    assert work.total_reads <= 2, work.reads
    poisoned = hidden.clone()
    poisoned[2] = float("nan")
    with HostWork() as work:
        drawn = sample(poisoned, lm_head, MIXED, positions, None, seen)
    assert work.total_reads <= 2, work.reads
    assert not math.isfinite(drawn[2].logprob)
    assert [_bits(d) for i, d in enumerate(drawn) if i != 2] == [_bits(d) for i, d in enumerate(clean) if i != 2]
    assert all(math.isfinite(d.logprob) for i, d in enumerate(drawn) if i != 2)


def _battery_inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logp [V] float32, seen [V] bool) rows from integer hashing and ops.log_softmax: ties, a row
    with some NaN entries and a row of NaN among them."""
    rows = []
    for i, (vocab, scale, quantized) in enumerate([(300, 8.0, False), (1000, 40.0, False), (4099, 12.0, False),
                                                  (777, 6.0, True)]):
        x = (uniform_noise(100 + i, 7, vocab) - 0.5) * scale
        if quantized:
            x = torch.floor(x)
        logp = ops.log_softmax(x.float())
        seen = uniform_noise(200 + i, 3, vocab) < 0.1
        rows.append((logp, seen))
    nan = rows[0][0].clone()
    nan[3::7] = float("nan")
    rows.append((nan, rows[0][1]))
    rows.append((torch.full_like(rows[1][0], float("nan")), rows[1][1]))
    return rows


BATTERY = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.3, top_k=3),
           SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.7, top_k=5, seed=6, logprobs=3),
           SamplingParams(temperature=1.3, top_p=0.9, seed=7),
           SamplingParams(temperature=1.0, min_p=0.05, seed=8, logprobs=20),
           SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02, repetition_penalty=1.5, seed=-3, logprobs=1),
           SamplingParams(temperature=2.0, top_p=0.3, repetition_penalty=0.8, seed=2**40 + 1)]
# sha256 of the battery's draws as the per-row sampler drew them (one row at a time, reading each
# row's token, logprob and top list back separately), before the rows were drawn together.
PER_ROW_SAMPLERS_DRAWS = "4f89bc4d1e0af47309b87bce1619c2e256e80efdfa7e459c257eb316beb0559e"


def test_the_draws_are_the_per_row_samplers():
    """Greedy and sampled draws with top-k, top-p, min-p, the repetition penalty, logprobs, seeds,
    streams, positions past 2^32, ties and NaN: the bits the per-row sampler gave, drawn a row at a
    time and drawn with the battery's eight parameter sets as the eight rows of one step."""
    alone, together = [], []
    for (logp, seen), position, stream in itertools.product(_battery_inputs(), (0, 13, 2**33 + 5), (0, 2)):
        alone.append([draw(logp, p, position, stream, seen) for p in BATTERY])
        rows = len(BATTERY)
        together.append(draw_rows(logp.expand(rows, -1), BATTERY, [position] * rows, [stream] * rows,
                                  seen.expand(rows, -1)))
    for draws in (alone, together):
        # in the per-row sampler's order: input, then parameters, then position and stream
        ordered = [draws[i * 6 + j][k] for i in range(len(_battery_inputs())) for k in range(len(BATTERY)) for j in range(6)]
        out = [[d.token, float(d.logprob).hex(), [[t, float(v).hex()] for t, v in d.top]] for d in ordered]
        assert hashlib.sha256(json.dumps(out).encode()).hexdigest() == PER_ROW_SAMPLERS_DRAWS


def test_off_the_cpu_top_p_sums_rows_in_an_order_of_their_own():
    """The running sums top-p takes off the CPU (a fixed scan in float64): a row's sums are the same
    whatever rows share the call, and on these inputs they are the CPU's torch.cumsum bits."""
    from lockstep.sampling import _scan
    probs = torch.exp(ops.log_softmax(_hashed(5, (5, 3001), 30.0)))
    ranked = torch.sort(probs, dim=-1, descending=True, stable=True).values
    sums = _scan(ranked.double()).float()
    assert all(torch.equal(_scan(ranked[i:i + 1].double()).float()[0], sums[i]) for i in range(5))
    assert torch.equal(sums, torch.cumsum(ranked, dim=-1))
