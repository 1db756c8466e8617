"""lockstep.parity.trajectories: two trainers side by side, step by step: loss, gradient norm and
parameter norm, the first step that leaves the contract, and its first diverging op.

`PlainTrainer` is the stock-PyTorch trainer a lockstep run is compared with (transformers' model,
torch.optim.AdamW): the baseline of the comparison, not a training path of lockstep's."""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
from torch import Tensor, nn

from .. import contract, registry
from .compare import compare, outcomes
from .recorder import Recorder



class PlainTrainer:
    """The plain PyTorch trainer of the parity checks: transformers' Llama/Qwen model built from the
    same weights, torch.optim.AdamW, F.cross_entropy summed over the window and divided by its
    tokens, torch's clip_grad_norm_, and lockstep's learning-rate schedule."""

    def __init__(self, lockstep_model, cfg):
        import transformers
        from transformers import AutoModelForCausalLM

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
        from ..train import lr_at, micro_batches, sequences_of

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


# The backends whose weight gradients go into lockstep.numerics.grad_tree's unit trees.
UNIT_TREE_BACKENDS = ("portable", "native", "triton")


def _param_norm(named) -> float:
    return math.sqrt(sum(float(p.detach().double().pow(2).sum()) for _, p in named))


def compare_trajectories(make_trainer: Callable[[], object], side_a: str, side_b: str, steps: int,
                         loss_tol: float | None = None, param_tol: float | None = None) -> dict:
    """Run two trainers on the same windows for `steps` steps.

    side: a backend name ("portable", "eager", ...) for a lockstep Trainer on that backend, or
    "plain" for PlainTrainer. Tolerances default to 0 (bitwise) for two lockstep trainers and to the
    trainer-parity contract against the plain trainer: there a step is inside when each difference
    is at most the contract's number plus `factor` times PyTorch's own error, the plain trainer's
    distance from lockstep's trainer in float64 on the reference backend, run on the same windows
    (docs/contract.md section 4, docs/adr/0031). Returns per-step rows, the first step outside the
    tolerance and, for two lockstep trainers, the first diverging op of that step."""

    trainers = {}
    for side in (side_a, side_b):
        t = make_trainer()
        if side not in UNIT_TREE_BACKENDS:
            t.layout_invariant = False         # its ops take no part in the unit trees
        trainers[side] = PlainTrainer(t.model, t.cfg) if side == "plain" else t
    base = trainers[side_a] if side_a != "plain" else trainers[side_b]
    plain_involved = "plain" in (side_a, side_b)
    parity_contract = contract.load().get("trainer_parity", {})
    error_factor = 0.0
    if plain_involved and (loss_tol is None or param_tol is None):
        error_factor = parity_contract.get("pytorch_error_factor", 2.0)
        trainers["float64"] = _float64_trainer(make_trainer())
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
            else:
                with registry.use_backend(side):
                    recs[side] = t.step(window)
            recs[side]["param_norm"] = _param_norm(_named_params(t, side).items())
        params = {side: _named_params(trainers[side], side) for side in (side_a, side_b)}
        param_diff = _max_param_diff(params[side_a], params[side_b])
        ra, rb = recs[side_a], recs[side_b]
        row = {"step": step + 1, **{f"{k}_a": ra[k] for k in ("loss", "grad_norm", "param_norm")},
               **{f"{k}_b": rb[k] for k in ("loss", "grad_norm", "param_norm")},
               "loss_diff": abs(ra["loss"] - rb["loss"]), "grad_norm_diff": abs(ra["grad_norm"] - rb["grad_norm"]),
               "param_norm_diff": abs(ra["param_norm"] - rb["param_norm"]), "max_param_diff": param_diff}
        step_loss_tol, step_param_tol = loss_tol, param_tol
        if error_factor:
            with registry.use_backend("reference"):
                truth = trainers["float64"].step(window)
            row["pytorch_loss_error"] = abs(truth["loss"] - recs["plain"]["loss"])
            row["pytorch_param_error"] = _max_param_diff(_named_params(trainers["float64"], "float64"), params["plain"])
            step_loss_tol += error_factor * row["pytorch_loss_error"]
            step_param_tol += error_factor * row["pytorch_param_error"]
        rows.append(row)
        if first_bad is None and (row["loss_diff"] > step_loss_tol or param_diff > step_param_tol):
            first_bad = step + 1
            if snapshot is not None:
                from ..train import micro_batches

                first, stop = micro_batches(window, 0, len(window), base.cfg.micro_batch_tokens)[0]
                op_divergence = _step_divergence(trainers[side_a], snapshot, window[first:stop], side_a, side_b)
    return {"side_a": side_a, "side_b": side_b, "loss_tol": loss_tol, "param_tol": param_tol,
            "pytorch_error_factor": error_factor, "rows": rows,
            "first_step_outside_contract": first_bad, "first_diverging_op": op_divergence}


def _float64_trainer(trainer):
    """A trainer in float64 built from `trainer`, to run on the reference backend: the same weights,
    data and config, its AdamW in float64 (docs/adr/0027). It takes `trainer`'s model over,
    converted in place, so pass a fresh one. It is the truth PyTorch's own error is measured
    against."""
    from ..train import Trainer

    return Trainer(trainer.model.to(torch.float64), trainer.data, trainer.cfg, layout_invariant=False)


def _named_params(trainer, side: str) -> dict[str, Tensor]:
    """The trainer's parameters by name: its live tensors, which each step updates in place."""
    return dict(trainer.named_parameters()) if side == "plain" else dict(trainer.named)


def _max_param_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(float((a[n].detach().double() - b[n].detach().double()).abs().max()) for n in a if n in b)


def _step_divergence(trainer, state: dict, micro_batch: list[Tensor], side_a: str, side_b: str) -> dict:
    """Record one forward+backward of the step's first micro-batch from the same pre-step weights
    under both backends, and compare."""
    from ..train import cross_entropy_sum

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
    from ..train import PackedDataset, TrainConfig, Trainer

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
                     + (f"  PyTorch's error {r['pytorch_param_error']:.2e}" if "pytorch_param_error" in r else ""))
    first = result["first_step_outside_contract"]
    error = (f", each plus {result['pytorch_error_factor']} x PyTorch's error (plain vs float64)"
             if result.get("pytorch_error_factor") else "")
    lines.append(f"first step outside the contract (loss {result['loss_tol']}, params {result['param_tol']}{error}): "
                 f"{first if first is not None else 'none'}")
    if result["first_diverging_op"]:
        for o in outcomes(result["first_diverging_op"]):
            d = o.first
            lines.append(f"  at that step, {o.phase}: " + ("identical" if d is None else
                         f"first divergence {o.module} {d.op} [{d.slot}], max abs diff "
                         f"{d.max_abs_diff:.3e}, max ulp diff {d.max_ulp_diff}"))
    return "\n".join(lines)
