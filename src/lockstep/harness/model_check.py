"""Model-level checks: per-token logprobs bitwise invariant across layouts, and the chain against
the same model run on the float64 reference ops (docs/contract.md, sections 2 and 4)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import contract
from ..numerics.fixed_order import ceil_div
from ..model import Transformer, logprobs
from ..model.moe import record_routing, replay_routing
from ..paged_cache import build_step
from ..registry import use_backend
from .check import SweepResult, bitwise_diff


def cached_logprobs(model: Transformer, seq: Tensor, chunk: int, block_size: int = 8) -> Tensor:
    """One sequence through the paged-cache path in chunks of `chunk` tokens (scattered blocks);
    the logprobs of its tokens 1..n-1."""
    n = seq.shape[0]
    blocks = ceil_div(n, block_size)
    cache = model.allocate_kv_cache(num_blocks=2 * blocks + 1, block_size=block_size)
    table = torch.randperm(2 * blocks + 1, generator=torch.Generator().manual_seed(n))[:blocks].tolist()
    hidden = []
    with torch.no_grad():
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            step, pos = build_step([(table, start, stop)], block_size, seq.device)
            hidden.append(model.forward_cached(seq[start:stop], pos, step, cache))
        return model.selected_logprobs(torch.cat(hidden)[:-1], seq[1:])


@dataclass
class ModelReport:
    dtype: str
    sweeps: list[SweepResult] = field(default_factory=list)
    max_abs_dlogp_vs_float64: float = 0.0
    tolerance: float = 0.0

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.sweeps) and self.max_abs_dlogp_vs_float64 <= self.tolerance


def _compare(name: str, want: list[Tensor], got: list[Tensor]) -> SweepResult:
    ok, worst, rows = True, 0.0, 0
    for a, b in zip(got, want):
        eq, d = bitwise_diff(a.detach(), b.detach())
        ok, worst, rows = ok and eq, max(worst, d if not eq else 0.0), rows + a.numel()
    return SweepResult(name, ok and rows > 0, worst, rows, "" if ok else "logprobs differ")


def prompt_set(vocab: int, seed: int = 0, lengths: tuple[int, ...] = (37, 2, 90, 16, 65)) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def check_model(model: Transformer, seqs: list[Tensor], chunks: tuple[int, ...] = (1, 7, 16)) -> ModelReport:
    """Invariance sweeps and the float64 chain for one model (in its own dtype)."""
    report = ModelReport(contract.dtype_name(model.dtype))
    with torch.no_grad():
        alone = [logprobs(model, [s])[0] for s in seqs]
        with record_routing() as routing:
            packed = logprobs(model, seqs)
        report.sweeps.append(_compare("packed together", alone, packed))
        report.sweeps.append(_compare("reversed order", alone, logprobs(model, seqs[::-1])[::-1]))
        junk = torch.zeros(29, dtype=torch.long)
        padded = logprobs(model, [junk] + [x for s in seqs for x in (s, junk)])
        report.sweeps.append(_compare("padding sequences between", alone, padded[1::2]))
        for chunk in chunks:
            report.sweeps.append(_compare(f"KV cache, chunks of {chunk}", alone,
                                          [cached_logprobs(model, s, chunk) for s in seqs]))
        ref = copy.deepcopy(model).to(torch.float64)
        with use_backend("reference"), replay_routing(routing):      # a mixture's experts as the model chose
            ref_lp = logprobs(ref, seqs)
    report.max_abs_dlogp_vs_float64 = max(float((a.double() - b).abs().max()) for a, b in zip(alone, ref_lp))
    report.tolerance = contract.chain_tolerance(model.dtype if model.dtype != torch.float64 else torch.float32)
    return report
