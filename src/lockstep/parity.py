"""lockstep.parity: find where two runs stop computing the same bits.

- `Recorder` records every op call of a forward and backward pass through a hook in the op
  registry, so it records the same thing whether the caller is the model, the engine or the
  trainer. A forward record holds the op's output. A backward record holds the gradient the op
  sends to each of its float inputs. Each record has the module path (`model.layers.3.mlp.down_proj`),
  the op name, the call index, shapes, dtype, a digest of the bits, max |x|, a float64 norm and,
  optionally, the tensor.
- `compare` aligns two recordings op by op and reports the first op whose bits differ, forward
  and then backward, with the max abs and max ULP difference, the number of differing elements,
  and the ops after it that it contaminated. A `RowView` restricts a recording to one sequence,
  so "alone vs in a batch of 8" compares like with like.
- `compare_trajectories` runs two trainers side by side and reports loss, gradient norm and
  parameter norm per step, and the first step that leaves the contract. When both trainers are
  lockstep trainers, it also reports the first diverging op of that step, from the same pre-step
  state.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from . import contract, registry
from .fixed_order import ceil_div


@dataclass
class OpRecord:
    index: int
    phase: str               # "forward" or "backward"
    module: str
    op: str
    slot: str                # "out", or "grad:<input index>" in backward
    shape: list[int]
    dtype: str
    digest: str
    max_abs: float
    norm64: float
    tensor: Tensor | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.module or '<top>'}:{self.op}[{self.slot}]"


def _summary(t: Tensor) -> tuple[str, float, float]:
    t = t.detach()
    digest = hashlib.sha1(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    if t.numel() == 0:
        return digest, 0.0, 0.0
    d = t.double()
    return digest, float(torch.nan_to_num(d.abs(), nan=math.inf).max()), float(torch.linalg.vector_norm(d))


class _Tap(torch.autograd.Function):
    """Identity; in backward it records the gradient that one op sends to one of its inputs."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.callback(g)
        return g, None


class Recorder:
    """`with Recorder(model) as rec:` records every lockstep op call in the block (and its backward).

    model: optional; when given, records carry the path of the module that called the op."""

    def __init__(self, model: nn.Module | None = None, keep_tensors: bool = True):
        self.model, self.keep = model, keep_tensors
        self.forward: list[OpRecord] = []
        self.backward: list[OpRecord] = []
        self._stack: list[str] = []
        self._hooks: list = []

    def __enter__(self) -> "Recorder":
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._hooks.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._hooks.append(module.register_forward_hook(self._leave_module))
        registry.RECORDERS.append(self)
        return self

    def _enter_module(self, name: str) -> Callable:
        def hook(module, args) -> None:
            self._stack.append(name)
        return hook

    def _leave_module(self, module, args, output) -> None:
        self._stack.pop()     # returns None, so the module's output is left alone

    def __exit__(self, *exc) -> None:
        registry.RECORDERS.remove(self)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _record(self, phase: str, module: str, op: str, slot: str, t: Tensor) -> None:
        digest, mx, norm = _summary(t)
        target = self.forward if phase == "forward" else self.backward
        target.append(OpRecord(len(target), phase, module, op, slot, list(t.shape), str(t.dtype).removeprefix("torch."),
                               digest, mx, norm, t.detach().clone() if self.keep else None))

    def wrap(self, op: str, impl: Callable) -> Callable:
        def recorded(*args):
            module = self._stack[-1] if self._stack else ""
            tapped = list(args)
            for i, a in enumerate(args):
                if isinstance(a, Tensor) and a.is_floating_point() and a.requires_grad:
                    tapped[i] = _Tap.apply(a, lambda g, i=i: self._record("backward", module, op, f"grad:{i}", g))
            out = impl(*tapped)
            self._record("forward", module, op, "out", out)
            return out
        return recorded


@dataclass
class RowView:
    """Which rows of a recording belong to the sequence under comparison.

    tokens: (start, stop) of its tokens in the packed batch of n_tokens; tensors whose first
    dimension is n_tokens are cut to those rows. Logprob outputs (one row per predicted token,
    n_tokens - n_seqs rows) are cut to the sequence's predictions. Other tensors (weights and
    their gradients) are compared whole, and only when their shapes agree."""

    n_tokens: int
    n_seqs: int
    tokens: tuple[int, int]
    seq_index: int

    def select(self, t: Tensor) -> Tensor | None:
        a, b = self.tokens
        if t.dim() >= 1 and t.shape[0] == self.n_tokens:
            return t[a:b]
        if t.dim() >= 1 and t.shape[0] == self.n_tokens - self.n_seqs:
            return t[a - self.seq_index:b - self.seq_index - 1]
        return t


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
    for phase in ("forward", "backward"):
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


def format_comparison(c: Comparison, label_a: str, label_b: str) -> str:
    lines = [f"parity: {label_a}  vs  {label_b}"]
    for phase in ("forward", "backward"):
        d = c.first[phase]
        if c.compared[phase] == 0:
            lines.append(f"  {phase:8s}: not compared (no op records on both sides; a KV-cache layout has no backward)")
        elif d is None:
            lines.append(f"  {phase:8s}: identical ({c.compared[phase]} op records compared)")
        else:
            lines.append(f"  {phase:8s}: first divergence at #{d.index} {d.module or '<top>'} {d.op} [{d.slot}]: "
                         f"max abs diff {d.max_abs_diff:.3e}, max ulp diff {d.max_ulp_diff}, "
                         f"{d.differing}/{d.elements} elements differ")
            if d.contaminated_count:
                more = d.contaminated_count - len(d.contaminated)
                lines.append(f"            then {d.contaminated_count} later records differ: "
                             + ", ".join(d.contaminated) + (f", ... (+{more})" if more > 0 else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Configured runs for `lockstep parity`
# --------------------------------------------------------------------------------------------
# The largest batch (layout=batchN) and chunk (layout=chunkN) a parity run takes.
MAX_BATCH = 256


@dataclass
class RunConfig:
    """backend, layout and dtype of one side. layout: "alone", "batch<N>" (the sequence at
    position 1 of N sequences, or 0 if N is 1), "chunk<C>" (prefill through the KV cache in chunks of
    C, forward only) or "decode" (token by token from the KV cache, forward only)."""

    backend: str = "portable"
    layout: str = "alone"
    dtype: str = "fp32"

    @classmethod
    def parse(cls, text: str) -> "RunConfig":
        out = cls()
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ValueError(f"config: expected key=value pairs (backend=, layout=, dtype=), got {part!r}")
            key, value = (s.strip() for s in part.split("=", 1))
            if key not in ("backend", "layout", "dtype"):
                raise ValueError(f"config: unknown key {key!r}; expected backend, layout or dtype")
            setattr(out, key, value)
        contract.parse_dtype(out.dtype)
        if out.backend not in registry.available_backends():
            raise ValueError(f"config: unknown backend {out.backend!r}; expected one of {registry.available_backends()}")
        if not (out.layout in ("alone", "decode") or (out.layout[:5] == "batch" and out.layout[5:].isdigit())
                or (out.layout[:5] == "chunk" and out.layout[5:].isdigit())):
            raise ValueError(f"config: unknown layout {out.layout!r}; expected alone, batchN, chunkN or decode")
        n = int(out.layout[5:]) if out.layout[:5] in ("batch", "chunk") else 1
        if not 1 <= n <= MAX_BATCH:
            raise ValueError(f"config: layout {out.layout!r} needs N in [1, {MAX_BATCH}], got {n}")
        return out

    def __str__(self) -> str:
        return f"backend={self.backend},layout={self.layout},dtype={self.dtype}"


def record_run(model, target: Tensor, others: list[Tensor], cfg: RunConfig) -> tuple[Recorder, RowView]:
    """Forward (and, for packed layouts, backward of the target's summed logprobs) under `cfg`."""
    from .model import pack

    model = copy.deepcopy(model).to(contract.parse_dtype(cfg.dtype))
    if cfg.layout.startswith("chunk") or cfg.layout == "decode":
        chunk = 1 if cfg.layout == "decode" else int(cfg.layout[5:])
        with registry.use_backend(cfg.backend):
            rec = _record_cached(model, target, chunk)
        n = target.numel()
        return rec, RowView(n, 1, (0, n), 0)
    with registry.use_backend(cfg.backend), Recorder(model) as rec:
        n_batch = 1 if cfg.layout == "alone" else int(cfg.layout[5:])
        seqs = [target] if n_batch == 1 else ([others[0], target] + others[1:n_batch - 1])
        position = seqs.index(target) if n_batch == 1 else 1
        ids, cu = pack(seqs)
        hidden = model(ids, cu)
        keep = torch.ones(ids.shape[0], dtype=torch.bool)
        keep[cu[1:] - 1] = False
        rows = torch.nonzero(keep)[:, 0]
        lp = model.selected_logprobs(hidden[rows], ids[rows + 1])
        a, b = int(cu[position]), int(cu[position + 1])
        lp[a - position:b - position - 1].sum().backward()
    return rec, RowView(int(ids.shape[0]), len(seqs), (a, b), position)


def _record_cached(model, target: Tensor, chunk: int) -> Recorder:
    """Prefill `target` through the paged KV cache in chunks, one recorder per chunk, merged into one
    recording whose records hold the chunks' rows concatenated (paged_attention is named attention,
    so that it lines up with a packed run)."""
    from .paged_cache import build_step

    n, bs = target.numel(), 8
    blocks = ceil_div(n, bs)
    cache = model.allocate_kv_cache(blocks, bs)
    passes, hidden = [], []
    with torch.no_grad():
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            step, pos = build_step([(list(range(blocks)), start, stop)], bs)
            with Recorder(model) as rec:
                hidden.append(model.forward_cached(target[start:stop], pos, step, cache))
            passes.append(rec)
        with Recorder(model) as head:
            model.selected_logprobs(torch.cat(hidden)[:-1], target[1:])
    merged = Recorder(model)
    for i, records in enumerate(zip(*(p.forward for p in passes))):
        first = records[0]
        t = torch.cat([r.tensor for r in records])
        digest, mx, norm = _summary(t)
        op = "attention" if first.op == "paged_attention" else first.op
        merged.forward.append(OpRecord(i, "forward", first.module, op, first.slot, list(t.shape), first.dtype,
                                       digest, mx, norm, t))
    for r in head.forward:
        merged.forward.append(dataclasses.replace(r, index=len(merged.forward)))
    return merged


def parity(model, a: RunConfig, b: RunConfig, seed: int = 0, length: int = 24) -> Comparison:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    target = torch.randint(0, vocab, (length,), generator=gen)
    batch = max(int(c.layout[5:]) if c.layout.startswith("batch") else 1 for c in (a, b))
    lengths = torch.randint(3, 40, (max(8, batch - 1),), generator=gen)
    others = [torch.randint(0, vocab, (int(n),), generator=gen) for n in lengths]
    rec_a, view_a = record_run(model, target, others, a)
    rec_b, view_b = record_run(model, target, others, b)
    return compare(rec_a, rec_b, view_a, view_b)


# --------------------------------------------------------------------------------------------
# Training trajectories
# --------------------------------------------------------------------------------------------
class PlainTrainer:
    """The plain PyTorch trainer of the parity checks: transformers' Llama/Qwen model built from the
    same weights, torch.optim.AdamW, F.cross_entropy summed over the window and divided by its
    tokens, torch's clip_grad_norm_, and lockstep's learning-rate schedule."""

    def __init__(self, lockstep_model, cfg):
        import transformers
        from transformers import AutoModelForCausalLM, PretrainedConfig  # noqa: F401

        c = lockstep_model.config
        hf_cfg = transformers.AutoConfig.for_model(c.family, **{k: v for k, v in c.to_hf().items()
                                                                  if k not in ("architectures", "model_type")})
        hf_cfg._attn_implementation = "eager"
        self.model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").to(lockstep_model.dtype)
        missing, unexpected = self.model.load_state_dict({n: p.detach().clone() for n, p in lockstep_model.named_parameters()},
                                                         strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise ValueError(f"plain trainer: weights do not map onto transformers (missing {missing}, unexpected {unexpected})")
        self.cfg = cfg
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                     weight_decay=cfg.weight_decay)
        self.step_idx = 0

    def step(self, window: list) -> dict:
        """One step on a window of sequences (or of micro-batches), cut into micro-batches of
        cfg.micro_batch_tokens tokens like lockstep's trainer."""
        from .train import lr_at, micro_batches, sequences_of

        sequences = sequences_of(window)
        n_tok = sum(s.numel() - 1 for s in sequences)
        self.opt.zero_grad()
        total = 0.0
        for first, stop in micro_batches(sequences, 0, len(sequences), self.cfg.micro_batch_tokens):
            mb = sequences[first:stop]
            # Equal-length sequences run as one batch, as a plain trainer would; others one by one.
            batches = [torch.stack(mb)] if len({s.numel() for s in mb}) == 1 else [s[None] for s in mb]
            for x in batches:
                logits = self.model(x[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                         x[:, 1:].reshape(-1), reduction="sum")
                (loss / n_tok).backward()
                total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip) if self.cfg.grad_clip > 0 \
            else torch.sqrt(sum((p.grad.float() ** 2).sum() for p in self.model.parameters()))
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step_idx, self.cfg.lr, self.cfg.warmup, self.cfg.steps, self.cfg.min_lr_ratio)
        self.opt.step()
        self.step_idx += 1
        return {"loss": total / n_tok, "grad_norm": float(norm)}

    def named_parameters(self):
        return self.model.named_parameters()


# The backends whose weight gradients go into lockstep.grad_tree's unit trees.
UNIT_TREE_BACKENDS = ("portable", "triton")


def _param_norm(named) -> float:
    return math.sqrt(sum(float(p.detach().double().pow(2).sum()) for _, p in named))


def compare_trajectories(make_trainer: Callable[[], object], side_a: str, side_b: str, steps: int,
                         loss_tol: float | None = None, param_tol: float | None = None) -> dict:
    """Run two trainers on the same windows for `steps` steps.

    side: a backend name ("portable", "eager", ...) for a lockstep Trainer on that backend, or
    "plain" for PlainTrainer. Tolerances default to 0 (bitwise) for two lockstep trainers and to the
    trainer-parity contract against the plain trainer: there a step is inside when each difference
    is at most the contract's number plus `factor` times PyTorch's own spread, the difference
    between the plain trainer and a trainer on the eager backend (stock ops, another reduction
    order), run on the same windows (docs/contract.md section 4). Returns per-step rows, the first
    step outside the tolerance and, for two lockstep trainers, the first diverging op of that step."""

    trainers = {}
    for side in (side_a, side_b):
        t = make_trainer()
        if side not in UNIT_TREE_BACKENDS:
            t.layout_invariant = False         # its ops take no part in the unit trees
        trainers[side] = PlainTrainer(t.model, t.cfg) if side == "plain" else t
    base = trainers[side_a] if side_a != "plain" else trainers[side_b]
    plain_involved = "plain" in (side_a, side_b)
    parity_contract = contract.load().get("trainer_parity", {})
    spread_factor = 0.0
    if plain_involved and (loss_tol is None or param_tol is None) and "eager" not in (side_a, side_b):
        spread_factor = parity_contract.get("pytorch_spread_factor", 2.0)
        trainers["pytorch-spread"] = make_trainer()
        trainers["pytorch-spread"].layout_invariant = False
    loss_tol = loss_tol if loss_tol is not None else (parity_contract.get("loss", 2e-5) if plain_involved else 0.0)
    param_tol = param_tol if param_tol is not None else (parity_contract.get("params", 3e-5) if plain_involved else 0.0)
    rows, first_bad, op_divergence = [], None, None
    for step in range(steps):
        window = base.window()
        snapshot = None if plain_involved or first_bad is not None else copy.deepcopy(trainers[side_a].model.state_dict())
        recs = {}
        for side in (side_a, side_b):
            t = trainers[side]
            if side == "plain":
                recs[side] = t.step(window)
                named = list(t.named_parameters())
            else:
                with registry.use_backend(side):
                    recs[side] = t.step(window)
                named = t.named
            recs[side]["param_norm"] = _param_norm(named)
        params = {side: dict(t.named_parameters()) if side == "plain" else dict(t.named) for side, t in trainers.items()}
        param_diff = _max_param_diff(params[side_a], params[side_b])
        ra, rb = recs[side_a], recs[side_b]
        row = {"step": step + 1, **{f"{k}_a": ra[k] for k in ("loss", "grad_norm", "param_norm")},
               **{f"{k}_b": rb[k] for k in ("loss", "grad_norm", "param_norm")},
               "loss_diff": abs(ra["loss"] - rb["loss"]), "grad_norm_diff": abs(ra["grad_norm"] - rb["grad_norm"]),
               "param_norm_diff": abs(ra["param_norm"] - rb["param_norm"]), "max_param_diff": param_diff}
        step_loss_tol, step_param_tol = loss_tol, param_tol
        if spread_factor:
            spread = trainers["pytorch-spread"]
            with registry.use_backend("eager"):
                rs = spread.step(window)
            row["pytorch_loss_spread"] = abs(rs["loss"] - recs["plain"]["loss"])
            row["pytorch_param_spread"] = _max_param_diff(params["pytorch-spread"], params["plain"])
            step_loss_tol += spread_factor * row["pytorch_loss_spread"]
            step_param_tol += spread_factor * row["pytorch_param_spread"]
        rows.append(row)
        if first_bad is None and (row["loss_diff"] > step_loss_tol or param_diff > step_param_tol):
            first_bad = step + 1
            if snapshot is not None:
                from .train import micro_batches

                first, stop = micro_batches(window, 0, len(window), base.cfg.micro_batch_tokens)[0]
                op_divergence = _step_divergence(trainers[side_a], snapshot, window[first:stop], side_a, side_b)
    return {"side_a": side_a, "side_b": side_b, "loss_tol": loss_tol, "param_tol": param_tol,
            "pytorch_spread_factor": spread_factor, "rows": rows,
            "first_step_outside_contract": first_bad, "first_diverging_op": op_divergence}


def _max_param_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(float((a[n].detach().double() - b[n].detach().double()).abs().max()) for n in a if n in b)


def _step_divergence(trainer, state: dict, micro_batch: list[Tensor], side_a: str, side_b: str) -> dict:
    """Record one forward+backward of the step's first micro-batch from the same pre-step weights
    under both backends, and compare."""
    from .train import cross_entropy_sum

    model = copy.deepcopy(trainer.model)
    model.load_state_dict(state)
    recs = []
    for side in (side_a, side_b):
        m = copy.deepcopy(model)
        with registry.use_backend(side), Recorder(m) as rec:
            loss, n = cross_entropy_sum(m, micro_batch)
            (loss / n).backward()
        recs.append(rec)
    return compare(recs[0], recs[1]).to_dict()


def trajectory_on_random_tokens(make_model: Callable[[], nn.Module], side_a: str, side_b: str, steps: int,
                                seed: int = 0) -> dict:
    """`compare_trajectories` of two sides ("plain" or a backend name) training copies of
    `make_model()` on 20,000 random tokens in sequences of 32, two micro-batches of 64 tokens a step."""
    from .train import PackedDataset, TrainConfig, Trainer

    for side in (side_a, side_b):
        if side != "plain" and side not in registry.available_backends():
            raise ValueError(f"trajectory: unknown side {side!r}; expected 'plain' or a backend "
                             f"{registry.available_backends()}")
    vocab = make_model().config.vocab_size
    tokens = torch.randint(0, vocab, (20000,), generator=torch.Generator().manual_seed(seed)).tolist()
    cfg = TrainConfig(steps=steps, seq_len=32, micro_batch_tokens=64, accum=2, lr=2e-3, warmup=2)

    def make_trainer():
        return Trainer(make_model(), PackedDataset(tokens, cfg.seq_len, cfg.micro_batch_tokens, seed), cfg)

    return compare_trajectories(make_trainer, side_a, side_b, steps)


def format_trajectory(result: dict) -> str:
    """`compare_trajectories`' result as text: a line per step, the first step outside the contract
    and, when known, the first op that diverged in it."""
    lines = []
    for r in result["rows"]:
        lines.append(f"step {r['step']:3d}  loss {r['loss_a']:.6f} {r['loss_b']:.6f}  |dloss| {r['loss_diff']:.2e}  "
                     f"grad norm {r['grad_norm_a']:.4f} {r['grad_norm_b']:.4f}  max |dparam| {r['max_param_diff']:.2e}"
                     + (f"  PyTorch's spread {r['pytorch_param_spread']:.2e}" if "pytorch_param_spread" in r else ""))
    first = result["first_step_outside_contract"]
    spread = (f", each plus {result['pytorch_spread_factor']} x PyTorch's spread"
              if result.get("pytorch_spread_factor") else "")
    lines.append(f"first step outside the contract (loss {result['loss_tol']}, params {result['param_tol']}{spread}): "
                 f"{first if first is not None else 'none'}")
    if result["first_diverging_op"]:
        c = result["first_diverging_op"]
        for phase in ("forward", "backward"):
            d = c["first"][phase]
            lines.append(f"  at that step, {phase}: " + ("identical" if d is None else
                         f"first divergence {d['module'] or '<top>'} {d['op']} [{d['slot']}], max abs diff "
                         f"{d['max_abs_diff']:.3e}, max ulp diff {d['max_ulp_diff']}"))
    return "\n".join(lines)
