"""lockstep.parity.compare: the first op at which two recordings stop holding the same bits, forward
then backward, with its max abs and ULP difference and the ops it contaminated."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .recorder import Recorder, RowView



def ulp_distance(a: Tensor, b: Tensor) -> int:
    """Largest distance in units in the last place between corresponding floats (NaN vs number: huge)."""
    if a.numel() == 0:
        return 0
    int_type = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
                torch.float16: torch.int16}[a.dtype]
    ia, ib = a.contiguous().view(int_type).to(torch.int64), b.contiguous().view(int_type).to(torch.int64)
    sign = {torch.int16: 1 << 15, torch.int32: 1 << 31, torch.int64: 1 << 63}[int_type]
    oa = torch.where(ia < 0, -(ia + sign), ia) if int_type != torch.int64 else torch.where(ia < 0, -(ia & ((1 << 63) - 1)), ia)
    ob = torch.where(ib < 0, -(ib + sign), ib) if int_type != torch.int64 else torch.where(ib < 0, -(ib & ((1 << 63) - 1)), ib)
    return int((oa - ob).abs().max())


@dataclass
class Divergence:
    phase: str
    index: int
    module: str
    op: str
    slot: str
    max_abs_diff: float
    max_ulp_diff: int
    differing: int
    elements: int
    contaminated: list[str] = field(default_factory=list)
    contaminated_count: int = 0


@dataclass
class Comparison:
    compared: dict[str, int]
    first: dict[str, Divergence | None]
    per_op: list[dict]                    # every compared record: phase, module, op, slot, max_abs_diff

    @property
    def identical(self) -> bool:
        return all(v is None for v in self.first.values()) and sum(self.compared.values()) > 0

    def to_dict(self) -> dict:
        return {"identical": self.identical, "compared": self.compared,
                "first": {k: (asdict(v) if v else None) for k, v in self.first.items()}, "per_op": self.per_op}


def _diff(a: Tensor, b: Tensor) -> tuple[bool, float, int, int]:
    same_nan = a.isnan() & b.isnan()
    neq = ~((a == b) | same_nan)
    d = (a.double() - b.double()).abs()
    d = torch.where(same_nan, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf))
    differing = int(neq.sum())
    return differing == 0, float(d.max()) if d.numel() else 0.0, (ulp_distance(a, b) if differing else 0), differing


def compare(a: Recorder, b: Recorder, view_a: RowView | None = None, view_b: RowView | None = None,
            contamination_limit: int = 8) -> Comparison:
    """First op whose bits differ, forward then backward; needs recordings with kept tensors."""
    first: dict[str, Divergence | None] = {}
    compared: dict[str, int] = {}
    per_op: list[dict] = []
    for phase in PHASES:
        ra, rb = getattr(a, phase), getattr(b, phase)
        div, count = None, 0
        for x, y in zip(ra, rb):
            if (x.op, x.slot) != (y.op, y.slot) or x.tensor is None or y.tensor is None:
                continue
            ta = view_a.select(x.tensor) if view_a else x.tensor
            tb = view_b.select(y.tensor) if view_b else y.tensor
            if ta is None or tb is None or ta.shape != tb.shape or ta.dtype != tb.dtype:
                continue
            same, mx, ulps, n_diff = _diff(ta, tb)
            count += 1
            per_op.append({"phase": phase, "module": x.module, "op": x.op, "slot": x.slot, "max_abs_diff": mx})
            if same:
                continue
            if div is None:
                div = Divergence(phase, x.index, x.module, x.op, x.slot, mx, ulps, n_diff, ta.numel())
            else:
                div.contaminated_count += 1
                if len(div.contaminated) < contamination_limit:
                    div.contaminated.append(x.name)
        first[phase], compared[phase] = div, count
    return Comparison(compared, first, per_op)


PHASES = ("forward", "backward")


@dataclass(frozen=True)
class PhaseOutcome:
    """What a report shows of one phase of a comparison, text or HTML alike: the op records
    compared on both sides and the first divergence, if any."""
    phase: str                            # "forward" or "backward"
    compared: int
    first: Divergence | None

    @property
    def status(self) -> str:
        """"not compared" (no op records on both sides), "identical" or "diverged"."""
        if not self.compared:
            return "not compared"
        return "identical" if self.first is None else "diverged"

    @property
    def module(self) -> str:
        """The diverging op's module path; "<top>" for an op called outside any submodule."""
        return self.first.module or "<top>"

    def sizes(self, number: Callable[[float], str]) -> str:
        """The divergence's sizes in words, the max abs diff written by `number`."""
        d = self.first
        return (f"max abs diff {number(d.max_abs_diff)}, max ulp diff {d.max_ulp_diff}, "
                f"{d.differing}/{d.elements} elements differ")

    def headline(self, number: Callable[[float], str]) -> str:
        """The phase's outcome in one sentence, numbers written by `number`."""
        if self.status == "not compared":
            return "not compared (no op records on both sides; a KV-cache layout has no backward)"
        if self.status == "identical":
            return f"identical ({self.compared} op records compared)"
        d = self.first
        return f"first divergence at #{d.index} {self.module} {d.op} [{d.slot}]: {self.sizes(number)}"

    @property
    def unlisted(self) -> int:
        """Contaminated records beyond the names the divergence lists."""
        return self.first.contaminated_count - len(self.first.contaminated)


def outcomes(c: Comparison | dict) -> list[PhaseOutcome]:
    """The forward and backward outcomes of `c`, a Comparison or its to_dict() form (parity.json,
    a trajectory's first_diverging_op)."""
    d = c.to_dict() if isinstance(c, Comparison) else c
    return [PhaseOutcome(phase, d["compared"].get(phase, 0),
                         Divergence(**d["first"][phase]) if d["first"].get(phase) else None) for phase in PHASES]


def format_comparison(c: Comparison, label_a: str, label_b: str) -> str:
    """`c` as text: a line per phase, and the records the first divergence contaminated."""
    lines = [f"parity: {label_a}  vs  {label_b}"]
    for o in outcomes(c):
        d = o.first
        lines.append(f"  {o.phase:8s}: " + o.headline(lambda x: f"{x:.3e}"))
        if d is not None and d.contaminated_count:
            lines.append(f"            then {d.contaminated_count} later records differ: "
                         + ", ".join(d.contaminated) + (f", ... (+{o.unlisted})" if o.unlisted > 0 else ""))
    return "\n".join(lines)
