"""lockstep.train.trainer: the training configuration and the Trainer, whose `step` is the one
optimizer step of every caller (supervised training, GRPO, the benchmarks).

One optimizer step per window, an ordered list of whole sequences (its units). A rank runs its share
of the units in micro-batches of at most `micro_batch_tokens` tokens. Every weight gradient, the loss
and the token count are sums over units by one canonical tree (lockstep.numerics.grad_tree, docs/adr/0007),
so the loss, the gradients, their norm and the update are bitwise the same for any micro-batch size,
number of accumulation steps, data-parallel size and tensor-parallel size. The `sync` (a
GradientSync) completes the trees across ranks.

While a window runs, the ops' backward passes put each unit's weight-gradient partials into the
active `UnitTrees` (a context variable: autograd gives a backward no other channel), not into
`p.grad`; `Trainer.accumulate` opens the trees, and any gradient found in `p.grad` afterwards is an
op outside them, which is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import checks
from ..numerics import grad_tree
from ..dist.data_parallel import share_of
from ..dist.tensor_parallel import reduction_parts
from ..numerics.fixed_order import row_sum
from ..model import Transformer, packed_logprobs, params_digest
from ..model.moe import record_router_logits
from . import checkpoint
from .checkpoint import TrainerState
from .data import PackedDataset, micro_batches, sequences_of
from .losses import CrossEntropy, RouterAuxLoss, TokenLoss
from .optim import AdamW, AdamWConfig, check_betas_and_eps, clip_scale, grad_norm, lr_at
from .sharded import ShardedAdamW, state_bytes
from .sync import GradientSync, SingleProcessSync


@dataclass
class TrainConfig:
    steps: int = 100
    seq_len: int = 64
    micro_batch_tokens: int = 256
    accum: int = 1
    lr: float = 1e-3
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    master_weights: bool = False
    save_every: int = 0
    keep_checkpoints: int = 2        # the newest N checkpoints stay on disk (0: every one)
    log_every: int = 1
    # Tokens per optimizer step across all ranks; 0: ranks x accum x micro_batch_tokens.
    global_batch_tokens: int = 0
    # AdamW's state on one data-parallel rank per element (lockstep.train.sharded, docs/adr/0037);
    # the layout: it changes no bit of the run, and a resumed run may change it.
    shard_optimizer: bool = False

    def validate(self) -> None:
        for name in ("steps", "seq_len", "micro_batch_tokens", "accum"):
            checks.int_at_least(name, getattr(self, name))
        for name in ("warmup", "save_every", "keep_checkpoints", "log_every", "global_batch_tokens"):
            checks.int_at_least(name, getattr(self, name), 0)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: expected a positive number, got {self.lr!r}")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay)
                and self.weight_decay >= 0):
            raise ValueError(f"weight_decay: expected a number >= 0, got {self.weight_decay!r}")
        if not (isinstance(self.grad_clip, (int, float)) and math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"grad_clip: expected a number >= 0 (0 disables clipping), got {self.grad_clip!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected a number in [0, 1], got {self.min_lr_ratio!r}")
        check_betas_and_eps(self.betas, self.eps)
        if not isinstance(self.shard_optimizer, bool):
            raise ValueError(f"shard_optimizer: expected True or False, got {self.shard_optimizer!r}")
        if self.global_batch_tokens:
            if self.global_batch_tokens % self.seq_len:
                raise ValueError(f"global_batch_tokens: expected a multiple of seq_len ({self.seq_len}), "
                                 f"got {self.global_batch_tokens}")
            if self.accum != 1:
                raise ValueError(f"accum: {self.accum} with global_batch_tokens {self.global_batch_tokens}; give one of "
                                 "them (with a global batch, each rank runs as many micro-batches as its share needs)")

    def window_sequences(self, data_parallel: int = 1) -> int:
        """Sequences per optimizer step (the window) across `data_parallel` ranks."""
        if self.global_batch_tokens:
            return self.global_batch_tokens // self.seq_len
        return data_parallel * self.accum * max(1, self.micro_batch_tokens // self.seq_len)


class NonFiniteLoss(RuntimeError):
    pass


def _grad_dtype(p: Tensor) -> torch.dtype:
    """The dtype gradients are kept in: fp32, or float64 for a float64 parameter."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


class Trainer:
    """Runs windows of sequences; `step()` is one optimizer step.

    data: where windows come from when `step` is given none (a PackedDataset; None when every window
    is given, as in RL). sync: how the run is spread over processes (default one process).
    layout_invariant=False reduces gradients in the order used before the unit trees (autograd's sum
    over micro-batches): for backends whose ops take no part in the trees (eager, reference), one
    process only; the update then depends on the micro-batch size."""

    def __init__(self, model: Transformer, data: PackedDataset | None, cfg: TrainConfig,
                 sync: GradientSync | None = None, layout_invariant: bool = True):
        cfg.validate()
        self.model, self.data, self.cfg = model, data, cfg
        self.sync = sync if sync is not None else SingleProcessSync()
        if not isinstance(self.sync, GradientSync):
            raise TypeError(f"sync: expected a GradientSync (lockstep.train.sync), got {type(self.sync).__name__}")
        if not layout_invariant and self.sync.world > 1:
            raise ValueError("layout_invariant: False needs one process; data and tensor parallelism complete the "
                             "unit trees")
        self.layout_invariant = layout_invariant
        self.named = [(n, p) for n, p in model.named_parameters()]
        self.parts = reduction_parts(model)
        adamw = AdamWConfig(cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay)
        # At one data-parallel rank, sharding is the unsharded optimizer: the one rank owns every element.
        self.opt = (ShardedAdamW(self.named, adamw, self.sync, master_weights=cfg.master_weights)
                    if cfg.shard_optimizer and self.sync.dp_size > 1
                    else AdamW(self.named, adamw, master_weights=cfg.master_weights))
        self.step_idx = 0
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.grads: dict[str, Tensor] = {}
        # Set by `resume`: the settings a resumed run changed ({name: [old, new]}) and the checkpoint's extra.
        self.resumed_changes: dict = {}
        self.resumed_extra: dict = {}

    @property
    def layout(self) -> dict:
        """How a window is spread: data- and tensor-parallel sizes, micro-batch tokens and this
        rank's micro-batches per window (none of it changes a bit of the run)."""
        units = self.cfg.window_sequences(self.sync.dp_size)
        start, stop = share_of(units, self.sync.dp_rank, self.sync.dp_size)
        per = max(1, self.cfg.micro_batch_tokens // self.cfg.seq_len)
        layout = {"data_parallel": self.sync.dp_size, "tensor_parallel": self.sync.tp_size,
                  "micro_batch_tokens": self.cfg.micro_batch_tokens, "accum": -(-(stop - start) // per)}
        if self.sharded:        # named only when on, so an unsharded run's layout reads as before
            layout["shard_optimizer"] = True
        return layout

    @property
    def sharded(self) -> bool:
        """Whether the optimizer's state is sharded over the data-parallel ranks (lockstep.train.sharded)."""
        return isinstance(self.opt, ShardedAdamW)

    def optimizer_state_bytes(self) -> int:
        """Bytes of AdamW's state (moments, master weights where kept) that this rank holds."""
        return state_bytes(self.opt)

    def window(self) -> list[Tensor]:
        """The next window's sequences (every rank draws the whole window)."""
        if self.data is None:
            raise ValueError("window: this trainer has no data; pass the window to step()")
        return self.data.take(self.cfg.window_sequences(self.sync.dp_size))

    def accumulate(self, window: list, masks: list | None = None, loss: TokenLoss | None = None
                   ) -> tuple[float, int]:
        """The gradients of the window's `loss` (default: cross entropy, token mean) into `self.grads`
        ({name: fp32 tensor}). Returns (loss, trained tokens).

        window: the window's sequences in order (a list of micro-batches is flattened: the trainer
        cuts its share into micro-batches of cfg.micro_batch_tokens itself); masks: for each
        sequence, [len - 1] bool marking the targets that count."""
        loss = loss if loss is not None else CrossEntropy()
        sequences = sequences_of(window)
        masks = sequences_of(masks) if masks is not None else [torch.ones(s.numel() - 1, dtype=torch.bool) for s in sequences]
        if len(masks) != len(sequences):
            raise ValueError(f"masks: expected one per sequence ({len(sequences)}), got {len(masks)}")
        bad = [i for i, (s, m) in enumerate(zip(sequences, masks)) if m.shape != (s.numel() - 1,)]
        if bad:
            i = bad[0]
            raise ValueError(f"masks: sequence {i} has {sequences[i].numel() - 1} targets, its mask shape is "
                             f"{tuple(masks[i].shape)}")
        total_tokens = sum(int(m.sum()) for m in masks)
        if total_tokens == 0:
            raise ValueError("window: no trained tokens (every target is ignored)")
        scales, normalizer = loss.weights(masks)
        weights = [m.to(torch.float32) * (scale / normalizer) for m, scale in zip(masks, scales)]
        start, stop = self.sync.share(len(sequences))
        for _, p in self.named:
            p.grad = None
        if not self.layout_invariant:
            return self._accumulate_autograd(sequences, masks, weights, loss, scales, normalizer), total_tokens
        trees = grad_tree.UnitTrees(self.named)
        aux = RouterAuxLoss.of(self.model, masks)
        with trees.active():
            for first, last in micro_batches(sequences, start, stop, self.cfg.micro_batch_tokens):
                trees.next_micro_batch()
                with record_router_logits() as router_logits:
                    lp, _ = packed_logprobs(self.model, sequences[first:last], loss.temperature, first_unit=first)
                terms, seed = self._terms(loss, lp, first, last, weights)
                sizes = [s.numel() - 1 for s in sequences[first:last]]
                unit_losses = [self._unit_loss(part, masks[i], scales[i])
                               for i, part in zip(range(first, last), torch.split(terms, sizes))]
                if aux is None:
                    lp.backward(seed)
                    for unit, value in zip(range(first, last), unit_losses):
                        trees.add_loss(unit, value)
                    continue
                aux_terms = aux.per_unit(router_logits, [s.numel() for s in sequences[first:last]],
                                         [bool(m.any()) for m in masks[first:last]])
                live = [t for t in aux_terms if t.requires_grad]
                torch.autograd.backward([lp] + live, [seed] + [torch.tensor(aux.weight, dtype=t.dtype) for t in live])
                for unit, value, term in zip(range(first, last), unit_losses, aux_terms):
                    # The unit's share of the window's loss, in the loss tree's units (x normalizer).
                    trees.add_loss(unit, value + term.detach() * (aux.weight * normalizer))
        stray = [n for n, p in self.named if p.grad is not None]
        if stray:
            from ..registry import current_backend

            raise RuntimeError(f"layout-invariant training: the gradient of {stray[0]} came from an op outside the unit "
                               f"trees (backend {current_backend()!r}); train on the native, portable or triton "
                               "backend, or pass layout_invariant=False")
        totals, loss_sum = self.sync.complete(trees, len(sequences))
        params = dict(self.named)
        self.grads = grad_tree.combine(totals, params, self.sync.gather_rows)
        return float(loss_sum) / normalizer, total_tokens

    @staticmethod
    def _terms(loss: TokenLoss, lp: Tensor, first: int, last: int, weights: list[Tensor]) -> tuple[Tensor, Tensor]:
        """A micro-batch's per-token loss terms, and the gradient to seed its logprobs with."""
        terms, slope = loss.terms(lp.detach(), first, last)
        w = torch.cat(weights[first:last]).to(lp.device)
        # where, not a product: an untrained token's slope may be anything, NaN included.
        return terms, torch.where(w != 0, slope * w, torch.zeros_like(slope)).to(lp.dtype)

    @staticmethod
    def _unit_loss(terms: Tensor, mask: Tensor, scale: float) -> Tensor:
        """One sequence's loss in the loss tree's units: its trained terms by the fixed-order row_sum."""
        value = row_sum(terms[mask.to(terms.device)])
        return value if scale == 1.0 else value * scale

    def _accumulate_autograd(self, sequences: list[Tensor], masks: list[Tensor], weights: list[Tensor],
                             loss: TokenLoss, scales: list[float], normalizer: float) -> float:
        loss_sum = 0.0
        for first, last in micro_batches(sequences, 0, len(sequences), self.cfg.micro_batch_tokens):
            lp, _ = packed_logprobs(self.model, sequences[first:last], loss.temperature)
            terms, seed = self._terms(loss, lp, first, last, weights)
            lp.backward(seed)
            sizes = [s.numel() - 1 for s in sequences[first:last]]
            loss_sum += sum(float(self._unit_loss(part, masks[i], scales[i]))
                            for i, part in zip(range(first, last), torch.split(terms, sizes)))
        self.grads = {n: p.grad.to(_grad_dtype(p)) for n, p in self.named if p.grad is not None}
        return loss_sum / normalizer

    def step(self, window: list | None = None, masks: list | None = None, loss: TokenLoss | None = None) -> dict:
        """One optimizer step: the gradients of every sequence of the window (the next one from the
        data when none is given) under `loss` (default: cross entropy), clipping by the global norm,
        one AdamW step. Returns the step's record: step, loss, grad_norm, lr, tokens."""
        window = window if window is not None else self.window()
        loss_value, total_tokens = self.accumulate(window, masks, loss)
        if not math.isfinite(loss_value):
            where = f" (data epoch {self.data.epoch}, sequence index {self.data.index})" if self.data is not None else ""
            raise NonFiniteLoss(f"non-finite loss {loss_value} at step {self.step_idx}{where}")
        norm = grad_norm(self.grads, self.parts, self.sync.gather_parts)
        lr = lr_at(self.step_idx, self.cfg.lr, self.cfg.warmup, self.cfg.steps, self.cfg.min_lr_ratio)
        self.opt.step(lr, grad_scale=clip_scale(norm, self.cfg.grad_clip), grads=self.grads)
        self.step_idx += 1
        return {"step": self.step_idx, "loss": loss_value, "grad_norm": float(norm), "lr": lr, "tokens": total_tokens}

    # --- state ----------------------------------------------------------------------------------
    def settings(self) -> dict:
        """What defines this run, as a checkpoint records it: the training config, the compute dtype,
        the data (a fingerprint of its sequences and order, or None when windows are given), the
        window in sequences, and the layout (which a resumed run may change)."""
        from dataclasses import asdict

        return {"train_config": asdict(self.cfg), "dtype": str(self.model.dtype).removeprefix("torch."),
                "data": self.data.fingerprint() if self.data is not None else None,
                "window": self.cfg.window_sequences(self.sync.dp_size), "layout": self.layout}

    def full_state(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(parameters, optimizer state) whole, gathered from the tensor-parallel ranks (and, for a
        sharded optimizer, from the data-parallel ranks): a checkpoint holds no rank's shard. Every
        rank must call it. A sharded optimizer's state comes whole to the data-parallel rank 0 of
        each tensor-parallel slice (global ranks 0 .. tp - 1, rank 0's tensor-parallel group, which
        the writer's full_tensor gathers over); the other ranks get {} for it."""
        params = {n: self.sync.full_tensor(n, p.detach()) for n, p in self.named}
        state = {}
        for key, t in self.opt.state_tensors().items():
            state[key] = self.sync.full_tensor(key.split(".", 1)[1], t)
        return params, state

    def save(self, out_dir: str, extra: dict | None = None) -> str:
        """checkpoint.save: out_dir/step-NNNNNN, atomically; `extra` (JSON) travels with it and
        `resume` puts it back in `resumed_extra`. Every rank calls it."""
        params, optimizer = self.full_state()
        state = TrainerState(self.step_idx, params, optimizer, self.rng.get_state(),
                             self.data.state() if self.data is not None else None, self.settings(), extra or {})
        return checkpoint.save(state, self.model, out_dir, self.cfg.keep_checkpoints, self.sync.world)

    def resume(self, out_dir: str) -> int:
        """Load out_dir/latest (checkpoint.load) at this trainer's layout, whatever the checkpoint's;
        returns the step. The allowed changes of setting, the layout's included, are kept in
        `resumed_changes`, the checkpoint's `extra` in `resumed_extra`."""
        path = checkpoint.latest_checkpoint(out_dir)
        state, changes = checkpoint.load(path, self.model.config, self.settings())
        try:
            self._load_state(state)
        except (KeyError, TypeError, RuntimeError) as e:    # a tensor missing or of another shape
            raise checkpoint.damaged(path, e) from None
        self.step_idx, self.resumed_changes, self.resumed_extra = state.step, changes, state.extra
        return self.step_idx

    def _load_state(self, state: TrainerState) -> None:
        """Put a checkpoint's whole tensors in place as this rank's shards, with the optimizer's,
        the data's and the RNG's state."""
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(self.sync.shard_tensor(n, state.params[n]))
        shards = {k: self.sync.shard_tensor(k.split(".", 1)[1], v) for k, v in state.optimizer.items()}
        self.opt.load_state_tensors(shards, state.step)
        if self.data is not None:
            self.data.load_state(state.data)
        self.rng.set_state(state.rng)

    def params_digest(self) -> str:
        """sha256 of this rank's parameters (its shards under tensor parallelism), by name."""
        return params_digest(self.named)
