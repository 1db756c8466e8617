"""The invariance sweeps and the accuracy check behind `lockstep check` and the test suite.

The reference layout is one batch of `Sizes.pool` rows in order. Every sweep builds another layout
of some of the same rows (alone, in pairs, permuted, padded, next to NaN rows, strided, on one
thread, again) and demands that each row's output and input gradients are bitwise those of the
reference layout (docs/contract.md, section 2). Weight gradients must be identical run to run, on 1 and
2 threads, and with zero-gradient padding rows appended.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from .. import contract, ops
from ..backends import reference
from ..numerics.fixed_order import ROW_TILE
from ..registry import cpu_backend, use_backend
from .specs import LARGE, OpSpec, Sizes, get

GARBAGE_PAD = "pad"   # finite garbage, zero upstream gradient
GARBAGE_NAN = "nan"   # NaN and Inf, NaN upstream gradient


@dataclass
class SweepResult:
    sweep: str
    passed: bool
    max_diff: float
    compared: int
    detail: str = ""
    promised: bool = True   # False: a sweep the backend's contract does not promise, reported only


def default_backend(device: str | torch.device = "cpu") -> str:
    """The backend lockstep runs on `device` when none is named: triton on CUDA; on a CPU, native where
    it builds, else portable."""
    return "triton" if torch.device(device).type == "cuda" else cpu_backend()


def threads_sweep(backend: str, result: SweepResult) -> SweepResult:
    """The "threads=1 vs 2" result as the contract reads it: a backend that does not promise thread-count
    invariance (contract.toml) reports a difference here without failing the check."""
    if result.passed or contract.promises_thread_invariance(backend):
        return result
    return SweepResult(result.sweep, True, result.max_diff, result.compared,
                       f"bits differ, which backend {backend!r} does not promise (its GEMMs follow this machine's "
                       f"BLAS; contract.toml): {result.detail}", promised=False)


@dataclass
class AccuracyResult:
    forward_max_abs: float
    forward_max_rel: float
    forward_excess: float           # <= 0: within the contract
    eager_forward_max_abs: float
    gradient_max_abs: float | None
    gradient_excess: float | None
    eager_gradient_max_abs: float | None
    ratio_vs_eager: float           # lockstep error / eager error (forward)
    relative_ok: bool
    passed: bool


@dataclass
class OpReport:
    op: str
    backend: str
    dtype: str
    accuracy: AccuracyResult | None
    sweeps: list[SweepResult] = field(default_factory=list)

    @property
    def invariant(self) -> bool:
        return bool(self.sweeps) and all(s.passed for s in self.sweeps)

    @property
    def first_failure(self) -> SweepResult | None:
        return next((s for s in self.sweeps if not s.passed), None)

    @property
    def passed(self) -> bool:
        return self.invariant and (self.accuracy is None or self.accuracy.passed)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["invariant"] = self.invariant
        d["passed"] = self.passed
        return d


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@dataclass
class Run:
    out: Tensor
    row_grads: dict[str, Tensor]
    param_grads: dict[str, Tensor]


class Pool:
    """The rows of one check: real rows, their upstream gradients, garbage rows and the weights."""

    def __init__(self, spec: OpSpec, dtype: torch.dtype, sizes: Sizes, seed: int, grad: bool, device: str = "cpu"):
        self.spec, self.dtype, self.sizes, self.grad, self.device = spec, dtype, sizes, grad, torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        self.rows = spec.rows(sizes.pool, gen, dtype, sizes)
        self.params = spec.params(gen, dtype, sizes)
        out = spec.call(ops, {k: v[:1] for k, v in self.rows.items()}, self.params)
        self.out_shape = tuple(out.shape[1:])
        self.out_dtype = out.dtype
        self.dy = (torch.randn((sizes.pool,) + self.out_shape, generator=gen, dtype=torch.float64)
                   * spec.grad_scale(sizes)).to(out.dtype)
        n_garbage = sizes.pool + 16
        garbage = spec.rows(n_garbage, gen, dtype, sizes)
        self.garbage = {GARBAGE_PAD: {k: (v * 100 if v.is_floating_point() else v) for k, v in garbage.items()},
                        GARBAGE_NAN: {}}
        for k, v in garbage.items():
            if v.is_floating_point():
                bad = v.clone()
                flat = bad.view(bad.shape[0], -1)
                flat[0::3, 0] = float("nan")
                flat[1::3] = float("inf")
                flat[2::3, -1] = float("-inf")
                self.garbage[GARBAGE_NAN][k] = bad
            else:
                self.garbage[GARBAGE_NAN][k] = v
        self.garbage_dy = {GARBAGE_PAD: torch.zeros((n_garbage,) + self.out_shape, dtype=out.dtype),
                           GARBAGE_NAN: torch.full((n_garbage,) + self.out_shape, float("nan"), dtype=out.dtype)}

    def build(self, layout: list[int], kind: str = GARBAGE_PAD) -> tuple[dict[str, Tensor], Tensor]:
        """Rows and upstream gradient for a layout; index -1 takes the next garbage row."""
        n_pool = self.sizes.pool
        index, g = [], 0
        for i in layout:
            if i >= 0:
                index.append(i)
            else:
                index.append(n_pool + g)
                g += 1
        idx = torch.tensor(index, dtype=torch.long)
        rows = {k: torch.cat([v, self.garbage[kind][k]])[idx] for k, v in self.rows.items()}
        dy = torch.cat([self.dy, self.garbage_dy[kind]])[idx]
        return rows, dy


def _strided(t: Tensor) -> Tensor:
    """The same values in a non-contiguous layout (every other element of a wider buffer)."""
    if t.dim() == 0:
        return t
    wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def run(pool: Pool, backend: str, layout: list[int], kind: str = GARBAGE_PAD, strided: bool = False) -> Run:
    rows, dy = pool.build(layout, kind)
    rows, dy = {k: v.to(pool.device) for k, v in rows.items()}, dy.to(pool.device)
    if strided:                         # after the move: a copy to another device comes back contiguous
        rows = {k: _strided(v) for k, v in rows.items()}
    params = {k: v.to(pool.device).clone().requires_grad_(pool.grad) for k, v in pool.params.items()}
    for v in rows.values():
        if v.is_floating_point() and pool.grad:
            v.requires_grad_(True)
    with use_backend(backend):
        out = pool.spec.call(ops, rows, params)
        if pool.grad:
            out.backward(dy)
    row_grads = {k: v.grad.cpu() for k, v in rows.items() if v.is_floating_point() and pool.grad}
    param_grads = {k: v.grad.cpu() for k, v in params.items() if pool.grad}
    return Run(out.detach().cpu(), row_grads, param_grads)


def bitwise_diff(a: Tensor, b: Tensor) -> tuple[bool, float]:
    """Bitwise comparison with NaN equal to NaN by position; also the max abs difference."""
    if a.shape != b.shape:
        return False, math.inf
    same_nan = a.isnan() & b.isnan()
    equal = bool(((a == b) | same_nan).all())
    d = (a.double() - b.double()).abs()
    d = torch.where(same_nan, torch.zeros_like(d), d)
    d = torch.where(d.isnan(), torch.full_like(d, math.inf), d)
    return equal, float(d.max()) if d.numel() else 0.0


def compare_rows(ref: Run, got: Run, layout: list[int], name: str, params_too: bool = False) -> SweepResult:
    positions = [p for p, i in enumerate(layout) if i >= 0]
    pool_idx = [layout[p] for p in positions]
    if not positions:
        return SweepResult(name, False, math.inf, 0, "no rows compared")
    pairs = [("output", got.out[positions], ref.out[pool_idx])]
    pairs += [(f"d{k}", got.row_grads[k][positions], ref.row_grads[k][pool_idx]) for k in ref.row_grads]
    if params_too:
        pairs += [(f"d{k}", got.param_grads[k], ref.param_grads[k]) for k in ref.param_grads]
    ok, worst, what = True, 0.0, ""
    for label, a, b in pairs:
        eq, d = bitwise_diff(a, b)
        if not eq:
            ok = False
            if d >= worst:
                worst, what = d, label
    return SweepResult(name, ok, worst, len(positions), "" if ok else f"{what} differs")


def layouts(n: int, gen: torch.Generator) -> list[tuple[str, list[int], str, bool]]:
    """(name, layout, garbage kind, compare weight gradients) for each sweep."""
    probes = [0, n // 2 + 1, n - 1]
    odd = 7
    big = ROW_TILE + 5
    perm = torch.randperm(n, generator=gen).tolist()
    full = list(range(n))
    interleaved = []
    for i in range(n):
        interleaved.append(i)
        if i % 3 == 0:
            interleaved.append(-1)
    out = [(f"batch=1 (row {p})", [p], GARBAGE_PAD, False) for p in probes]
    out += [("batch=2", [probes[1], probes[0]], GARBAGE_PAD, False)]
    if n > odd:
        out.append((f"batch={odd}", list(range(3, 3 + odd)), GARBAGE_PAD, False))
    if n > big + 3:
        out.append((f"batch={big}", list(range(2, 2 + big)), GARBAGE_PAD, False))
    out += [
        ("permutation", perm, GARBAGE_PAD, False),
        # Every row moves to another position inside its tile (unless it is the middle one).
        ("reversed", full[::-1], GARBAGE_PAD, False),
        ("pad left", [-1] * 5 + list(range(n)), GARBAGE_PAD, False),
        ("pad right", list(range(n)) + [-1] * 9, GARBAGE_PAD, True),
        ("NaN/Inf rows", interleaved, GARBAGE_NAN, False),
    ]
    return out


def invariance(pool: Pool, backend: str, seed: int) -> tuple[list[SweepResult], Run]:
    n = pool.sizes.pool
    full = list(range(n))
    gen = torch.Generator().manual_seed(seed + 1)
    results = []
    with num_threads(2):
        ref = run(pool, backend, full)
        for name, layout, kind, params_too in layouts(n, gen):
            results.append(compare_rows(ref, run(pool, backend, layout, kind), layout, name, params_too))
        results.append(compare_rows(ref, run(pool, backend, full, strided=True), full, "strided", True))
        results.append(compare_rows(ref, run(pool, backend, full), full, "repeat (determinism)", True))
    with num_threads(1):
        results.append(threads_sweep(backend, compare_rows(ref, run(pool, backend, full), full, "threads=1 vs 2", True)))
    return results, ref


def _reference_run(pool: Pool) -> Run:
    rows = {k: (v.double() if v.is_floating_point() else v).clone() for k, v in pool.rows.items()}
    params = {k: v.double().clone().requires_grad_(pool.grad) for k, v in pool.params.items()}
    for v in rows.values():
        if v.is_floating_point() and pool.grad:
            v.requires_grad_(True)
    out = pool.spec.call(reference, rows, params)
    if pool.grad:
        out.backward(pool.dy.double())
    return Run(out.detach(), {k: v.grad for k, v in rows.items() if v.is_floating_point() and pool.grad},
               {k: v.grad for k, v in params.items() if pool.grad})


def max_abs_error(a: Tensor, b: Tensor) -> float:
    d = (a.detach().double() - b.detach().double()).abs()
    d = torch.where(d.isnan(), torch.full_like(d, math.inf), d)
    return float(d.max()) if d.numel() else 0.0


def _all_grads(r: Run) -> list[Tensor]:
    return list(r.row_grads.values()) + list(r.param_grads.values())


def accuracy(pool: Pool, got: Run) -> AccuracyResult:
    op, dtype = pool.spec.name, pool.dtype
    ref = _reference_run(pool)
    with num_threads(2):
        eager = run(pool, "eager", list(range(pool.sizes.pool)))
    fwd_tol = contract.tolerance(op, dtype, "forward")
    fwd_err = max_abs_error(got.out, ref.out)
    rel = (got.out.double() - ref.out).abs() / ref.out.abs().clamp_min(1e-30)
    fwd_rel = float(torch.nan_to_num(rel, nan=math.inf).max())
    fwd_excess = fwd_tol.excess(got.out, ref.out)
    eager_fwd = max_abs_error(eager.out, ref.out)
    factor, floor_ulps = contract.relative_to_pytorch()
    out_dtype = pool.out_dtype
    relative_ok = fwd_err <= factor * eager_fwd + floor_ulps * contract.ulp(out_dtype, float(ref.out.abs().max()))
    grad_err = grad_excess = eager_grad = None
    if pool.grad:
        g_tol = contract.tolerance(op, dtype, "gradient")
        grad_err = max((max_abs_error(a, b) for a, b in zip(_all_grads(got), _all_grads(ref))), default=0.0)
        grad_excess = max((g_tol.excess(a, b) for a, b in zip(_all_grads(got), _all_grads(ref))), default=-1.0)
        eager_grad = max((max_abs_error(a, b) for a, b in zip(_all_grads(eager), _all_grads(ref))), default=0.0)
        for a, e, b in zip(_all_grads(got), _all_grads(eager), _all_grads(ref)):
            floor = floor_ulps * contract.ulp(a.dtype, float(b.abs().max()))
            relative_ok = relative_ok and max_abs_error(a, b) <= factor * max_abs_error(e, b) + floor
    passed = fwd_excess <= 0 and (grad_excess is None or grad_excess <= 0) and relative_ok
    ratio = fwd_err / eager_fwd if eager_fwd > 0 else (0.0 if fwd_err == 0 else math.inf)
    return AccuracyResult(fwd_err, fwd_rel, fwd_excess, eager_fwd, grad_err, grad_excess, eager_grad,
                          ratio, relative_ok, passed)


def check_op(name: str, dtype: torch.dtype, backend: str | None = None, grad: bool = True, seed: int = 0,
             sizes: Sizes | None = None, with_accuracy: bool = True, device: str = "cpu") -> OpReport:
    """Run every invariance sweep and (optionally) the accuracy check for one op and dtype, on
    `backend` (default: `default_backend(device)`).

    Inputs are generated on the CPU (the same values on any machine) and moved to `device`."""
    backend = backend or default_backend(device)
    spec = get(name)
    pool = Pool(spec, dtype, sizes or Sizes(), seed, grad and spec.differentiable, device)
    sweeps, ref = invariance(pool, backend, seed)
    acc = accuracy(pool, ref) if with_accuracy else None
    return OpReport(name, backend, contract.dtype_name(dtype), acc, sweeps)


def check_large(name: str, dtype: torch.dtype, backend: str | None = None, seed: int = 0,
                device: str = "cpu") -> SweepResult:
    """Each row alone vs all rows together at LLM-scale width (65,536 columns, 152k vocabulary)."""
    backend = backend or default_backend(device)
    spec = get(name)
    pool = Pool(spec, dtype, LARGE, seed, grad=spec.differentiable, device=device)
    n = LARGE.pool
    with num_threads(2):
        ref = run(pool, backend, list(range(n)))
        worst = SweepResult(f"large (width {LARGE.hidden}/{LARGE.vocab}) batch=1", True, 0.0, 0)
        for p in range(n):
            r = compare_rows(ref, run(pool, backend, [p]), [p], worst.sweep)
            worst.compared += r.compared
            if not r.passed:
                worst.passed, worst.max_diff, worst.detail = False, max(worst.max_diff, r.max_diff), r.detail
    return worst
