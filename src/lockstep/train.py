"""lockstep.train: deterministic training on a lockstep model, with the same ops as the engine.

- Loss: cross entropy over packed sequences through `selected_logprobs` (never the full logits),
  normalized by the non-ignored tokens of the whole window. Per-micro-batch normalization would
  weight a token of a short micro-batch more than one of a long micro-batch.
- Windows: one optimizer step per window, an ordered list of whole sequences (its units). A rank
  runs its share of the units in micro-batches of at most `micro_batch_tokens` tokens. Every
  weight gradient, the loss and the token count are sums over units by one canonical tree
  (lockstep.grad_tree, docs/adr/0007), so the loss, the gradients, their norm and the update are
  bitwise the same for any micro-batch size, number of accumulation steps, data-parallel size and
  tensor-parallel size. The `sync` (lockstep.dist.Parallel, or one process) completes the trees.
- AdamW with decoupled weight decay and bias correction, built from basic elementwise ops in a fixed
  order. The global gradient norm is computed in fp32: each tensor's sum of squares by the
  fixed-order `row_sum`, then the tensors in parameter order. Warmup then cosine schedule. fp32
  master weights are optional when the model computes in bf16.
- State: checkpoints hold safetensors weights, the optimizer state, the RNG state, the step and the
  data position, whole (never a rank's shard), so a run resumes at another layout. They are written
  to a temporary folder and renamed into place, so a crash never leaves a checkpoint that loads
  half-written. Resuming continues bitwise like an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import Tensor

from . import grad_tree
from .chunks import row_chunks
from .dist import reduction_parts, share_of
from .fixed_order import row_sum, tree_sum
from .model import ModelConfig, Transformer, load_tokenizer, model_from_source, pack
from .model.files import read_json, read_tensors, safetensors_files
from .model.moe import record_router_logits


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------
def token_logprobs(model: Transformer, sequences: list[Tensor], first_unit: int = 0) -> tuple[Tensor, Tensor]:
    """logprobs of tokens 1..n-1 of every packed sequence, float32 [sum(n - 1)], and their targets.

    Inside a unit tree (lockstep.grad_tree), sequence i is unit first_unit + i."""
    ids, cu = pack(sequences, model.device)
    with grad_tree.unit_rows(cu, first_unit):
        hidden = model(ids, cu)
    keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    keep[cu[1:] - 1] = False
    rows = torch.nonzero(keep)[:, 0]
    targets = ids[rows + 1]
    kept = cu - torch.arange(cu.numel(), device=cu.device)       # sequence i keeps len_i - 1 rows
    with grad_tree.unit_rows(kept, first_unit):
        return model.selected_logprobs(hidden[rows], targets), targets


def cross_entropy_sum(model: Transformer, sequences: list[Tensor], loss_mask: list[Tensor] | None = None) -> tuple[Tensor, int]:
    """Sum of -log p over the trained tokens of packed sequences, and their count.

    loss_mask[i] ([len_i - 1] bool) marks the targets of sequence i that count (the rest are
    ignored, like ignore_index). Padding sequences are all-False."""
    lp, _ = token_logprobs(model, sequences)
    if loss_mask is not None:
        mask = torch.cat([m.to(lp.device) for m in loss_mask])
        lp = lp[mask]
    return -lp.sum(), int(lp.numel())


class RouterAuxLoss:
    """A mixture's load-balancing loss in the training objective, when the model's config asks for it
    (output_router_logits, as transformers does): loss = cross-entropy token mean + coef x the mean
    over the window's trained sequences of each sequence's load-balancing loss
    (lockstep.model.moe.load_balancing_loss over that sequence's tokens, every sparse layer).

    transformers computes it over whatever micro-batch the forward saw, so its value changes with the
    micro-batch size; per sequence it is a function of the sequence alone, and the window's gradients
    keep their layout invariance (docs/adr/0008-mixture-of-experts.md)."""

    def __init__(self, config: ModelConfig, trained_units: int):
        self.config = config
        self.weight = config.router_aux_loss_coef / trained_units

    @classmethod
    def of(cls, model: Transformer, masks: list[Tensor]) -> "RouterAuxLoss | None":
        c = model.config
        if not (c.num_experts and c.output_router_logits and c.router_aux_loss_coef):
            return None
        trained = sum(1 for m in masks if bool(m.any()))
        return cls(c, trained) if trained else None

    def per_unit(self, router_logits: list[Tensor], lengths: list[int], trained: list[bool]) -> list[Tensor]:
        """Each sequence's loss (0-dim fp32; an exact 0, without a graph, for one without trained
        tokens) from the per-layer router logits [T, E] of a micro-batch of sequences of `lengths`."""
        from .model.moe import load_balancing_loss

        out, start = [], 0
        for n, counts in zip(lengths, trained):
            rows = [r[start:start + n] for r in router_logits]
            out.append(load_balancing_loss(rows, self.config.num_experts, self.config.num_experts_per_tok)
                       if counts else torch.zeros((), dtype=torch.float32))
            start += n
        return out


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip: float = 0.2,
                normalizer: float | None = None) -> Tensor:
    """PPO-clip / GRPO token loss: -min(r A, clip(r, 1 - clip, 1 + clip) A), r = exp(lp - lp_old).

    All inputs are [tokens] (advantages broadcast per token); the masked sum is divided by
    `normalizer` (the window's token count; default: this call's mask count)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    total = per_token[mask].sum()
    return total / (normalizer if normalizer is not None else max(1, int(mask.sum())))


# --------------------------------------------------------------------------------------------
# Optimizer and schedule
# --------------------------------------------------------------------------------------------
@dataclass
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


class AdamW:
    """AdamW in a fixed order of elementwise ops, over named parameters in name order.

    With `master_weights`, the optimizer keeps fp32 copies and writes rounded values back into the
    (bf16) model after every step."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: AdamWConfig, master_weights: bool = False):
        self.cfg = cfg
        self.params = sorted(named_params, key=lambda kv: kv[0])
        self.step_count = 0
        self.master = {n: p.detach().to(torch.float32).clone() for n, p in self.params} if master_weights else None
        self.exp_avg = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in self.params}
        self.exp_avg_sq = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in self.params}

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0, grads: dict[str, Tensor] | None = None) -> None:
        """One update from `grads` ({name: gradient}, any float dtype; default: each p.grad).
        A parameter without a gradient is left as it is."""
        self.step_count += 1
        b1, b2 = self.cfg.betas
        bc1 = 1 - b1 ** self.step_count
        bc2_sqrt = math.sqrt(1 - b2 ** self.step_count)
        for name, p in self.params:
            grad = p.grad if grads is None else grads.get(name)
            if grad is None:
                continue
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            w = self.master[name] if self.master is not None else p.data
            model = p.data if self.master is not None else None
            if not w.is_contiguous() or (model is not None and not model.is_contiguous()):
                self._update(grad, m, v, w, model, lr, grad_scale, bc1, bc2_sqrt)
                continue
            # Flat cache-sized chunks: the update is elementwise, so the bits are those of the
            # whole-tensor chain (tests/test_chunks.py), at a fraction of its memory traffic.
            flat = [None if t is None else t.view(-1) for t in (m, v, w, model)]
            grad = grad.reshape(-1)
            for s, e in row_chunks(grad.numel(), 1):
                self._update(grad[s:e], *(None if t is None else t[s:e] for t in flat), lr, grad_scale, bc1, bc2_sqrt)

    def _update(self, grad: Tensor, m: Tensor, v: Tensor, w: Tensor, model: Tensor | None, lr: float,
                grad_scale: float, bc1: float, bc2_sqrt: float) -> None:
        """The AdamW update of one tensor or chunk, in place on m and v (fp32) and on the weights w
        (the model's, or fp32 master weights whose rounded values are then written into `model`)."""
        b1, b2 = self.cfg.betas
        # One IEEE op per line, in place where the result is not needed twice: the same bits as the
        # expression form, without an allocation for every op.
        g = grad.to(torch.float32)
        if grad_scale != 1.0:
            g = g * grad_scale
        tmp = g * (1 - b1)
        m.mul_(b1).add_(tmp)                                       # m * b1 + g * (1 - b1)
        torch.mul(g, g, out=tmp).mul_(1 - b2)
        v.mul_(b2).add_(tmp)                                       # v * b2 + (g * g) * (1 - b2)
        wf = w if w.dtype == torch.float32 else w.to(torch.float32)
        if self.cfg.weight_decay:
            wf.mul_(1 - lr * self.cfg.weight_decay)
        torch.sqrt(v, out=tmp).div_(bc2_sqrt).add_(self.cfg.eps)  # denom
        torch.div(m, tmp, out=tmp).mul_(lr / bc1)
        wf.sub_(tmp)                                               # w - (m / denom) * (lr / bc1)
        if wf is not w:  # a bf16 / fp16 model without master weights
            w.copy_(wf)
        if model is not None:
            model.copy_(wf)

    def state_tensors(self) -> dict[str, Tensor]:
        out = {f"exp_avg.{n}": t for n, t in self.exp_avg.items()}
        out.update({f"exp_avg_sq.{n}": t for n, t in self.exp_avg_sq.items()})
        if self.master is not None:
            out.update({f"master.{n}": t for n, t in self.master.items()})
        return out

    def load_state_tensors(self, tensors: dict[str, Tensor], step: int) -> None:
        for n in self.exp_avg:
            self.exp_avg[n].copy_(tensors[f"exp_avg.{n}"])
            self.exp_avg_sq[n].copy_(tensors[f"exp_avg_sq.{n}"])
            if self.master is not None:
                self.master[n].copy_(tensors[f"master.{n}"])
        self.step_count = step


def grad_norm(grads: dict[str, Tensor], parts: dict[str, tuple[int, int]] | None = None,
              gather: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Global L2 norm of gradients {name: tensor}, fp32, in a fixed order: parameters by name, each
    one's sum of squares by `square_sum`.

    parts[name] = (dim, k) sums a parameter's squares in k slices along dim, combined by the
    canonical tree: the slices tensor parallelism shards, so that every tensor-parallel size sums
    the same slices. Under tensor parallelism, `gather` turns this rank's [n] slice sums into every
    rank's ([tp, n], rank order); replicated parameters are counted once."""
    parts = parts or {}
    names = sorted(n for n, g in grads.items() if g is not None)
    split = [n for n in names if n in parts]
    local = []
    for n in split:
        dim, k = parts[n]
        size = grads[n].shape[dim] // k
        local += [square_sum(grads[n].narrow(dim, i * size, size)) for i in range(k)]
    gathered = None
    if local:
        mine = torch.stack(local).cpu()
        gathered = gather(mine) if gather is not None else mine[None]
    total = torch.zeros((), dtype=torch.float32)
    offset = 0
    for n in names:
        if n in parts:
            k = parts[n][1]
            total = total + tree_sum(list(gathered[:, offset:offset + k].reshape(-1)))
            offset += k
        else:
            total = total + square_sum(grads[n]).cpu()
    return torch.sqrt(total)


def square_sum(grad: Tensor) -> Tensor:
    """The sum of squares of a gradient (any float dtype), fp32 scalar: each square in fp32, `row_sum`
    over the last dimension, then over the row sums (for 0-d and 1-d tensors, one row_sum). A fixed
    order that depends on the shape alone, vectorised over rows (a flat row_sum of a
    vocabulary-sized table is a Python loop of its length / SUM_WIDTH steps), and squared in
    cache-sized row chunks (lockstep.chunks), which changes no bit."""
    grad = grad.detach()
    if grad.dim() < 2:
        return row_sum(grad.to(torch.float32).square().reshape(1, -1))[0]
    rows = grad.reshape(-1, grad.shape[-1])
    sums = torch.empty(rows.shape[0], dtype=torch.float32, device=grad.device)
    for s, e in row_chunks(rows.shape[0], rows.shape[1]):
        sums[s:e] = row_sum(rows[s:e].to(torch.float32).square())
    return row_sum(sums[None])[0]


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup for `warmup` steps, then cosine decay to min_lr_ratio * base_lr at `total`."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
def read_texts(path: str) -> list[str]:
    """A text file, or every *.txt / *.md file of a folder in sorted order."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".txt", ".md")))
        if not files:
            raise FileNotFoundError(f"data: no .txt or .md files in {path}")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"data: {path!r} does not exist")
    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    if not any(t.strip() for t in texts):
        raise ValueError(f"data: {path} holds no text")
    return texts


class PackedDataset:
    """Token stream cut into sequences of `seq_len` tokens, shuffled by seed, epoch by epoch.

    A micro-batch is `micro_batch_tokens // seq_len` sequences; the position (epoch, index) is
    part of the training state."""

    def __init__(self, tokens: list[int], seq_len: int, micro_batch_tokens: int, seed: int):
        if seq_len < 2:
            raise ValueError(f"seq_len: expected >= 2, got {seq_len}")
        if micro_batch_tokens < seq_len:
            raise ValueError(f"micro_batch_tokens: expected >= seq_len ({seq_len}), got {micro_batch_tokens}")
        n = len(tokens) // seq_len
        if n < 1:
            raise ValueError(f"data: {len(tokens)} tokens make no sequence of {seq_len}")
        self.sequences = torch.tensor(tokens[: n * seq_len], dtype=torch.int64).view(n, seq_len)
        self.per_batch = micro_batch_tokens // seq_len
        self.seed = seed
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> Tensor:
        return torch.randperm(self.sequences.shape[0], generator=torch.Generator().manual_seed(self.seed * 1000003 + epoch))

    def next_batch(self) -> list[Tensor]:
        """The next micro-batch of `per_batch` sequences."""
        return self.take(self.per_batch)

    def take(self, n: int) -> list[Tensor]:
        """The next `n` sequences."""
        out = []
        for _ in range(n):
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._perm(self.epoch)
            out.append(self.sequences[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def fingerprint(self) -> str:
        """A digest of the sequences and how they are drawn: equal exactly when two datasets give the
        same sequences in the same order (however they are cut into micro-batches)."""
        h = hashlib.sha256(f"{self.seed} {tuple(self.sequences.shape)}".encode())
        h.update(self.sequences.numpy().tobytes())
        return h.hexdigest()[:16]

    def load_state(self, s: dict) -> None:
        self.epoch, self.index = int(s["epoch"]), int(s["index"])
        self._order = self._perm(self.epoch)


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------
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
    log_every: int = 1
    # Tokens per optimizer step across all ranks; 0: ranks x accum x micro_batch_tokens.
    global_batch_tokens: int = 0

    def validate(self) -> None:
        for name in ("steps", "seq_len", "micro_batch_tokens", "accum"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        for name in ("warmup", "save_every", "log_every", "global_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: expected a positive number, got {self.lr!r}")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay)
                and self.weight_decay >= 0):
            raise ValueError(f"weight_decay: expected a number >= 0, got {self.weight_decay!r}")
        if not (isinstance(self.grad_clip, (int, float)) and math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"grad_clip: expected a number >= 0 (0 disables clipping), got {self.grad_clip!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected a number in [0, 1], got {self.min_lr_ratio!r}")
        if not (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"eps: expected a positive number, got {self.eps!r}")
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


# What a resumed run may change (logged); every other setting defines the run and must match. The
# micro-batch size, the accumulation steps and the global batch setting may change as long as the
# window (sequences per step) stays: they are the layout, like the data- and tensor-parallel sizes.
RESUMABLE = ("steps", "save_every", "log_every", "micro_batch_tokens", "accum", "global_batch_tokens")


class NonFiniteLoss(RuntimeError):
    pass


def sequences_of(window: list) -> list:
    """A window given as micro-batches (lists) -> its sequences in order."""
    return [s for item in window for s in (item if isinstance(item, (list, tuple)) else [item])]


def _grad_dtype(p: Tensor) -> torch.dtype:
    """The dtype gradients are kept in: fp32, or float64 for a float64 parameter."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def model_fingerprint(config: ModelConfig) -> str:
    d = asdict(config)
    d.pop("extra", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


class SingleProcess:
    """The trainer's sync when it runs alone: every unit is local and the trees complete here.
    lockstep.dist.Parallel is the same interface over data- and tensor-parallel ranks."""

    rank, world, dp_rank, dp_size, tp_rank, tp_size = 0, 1, 0, 1, 0, 1

    def share(self, units: int) -> tuple[int, int]:
        return 0, units

    def complete(self, trees: grad_tree.UnitTrees, units: int) -> tuple[dict, Tensor]:
        return {k: trees.trees[k].total() for k in trees.keys()}, trees.loss.total()

    def gather_rows(self, name: str, g: Tensor) -> Tensor:
        return g

    def gather_parts(self, t: Tensor) -> Tensor:
        return t[None]

    def full_tensor(self, name: str, t: Tensor) -> Tensor:
        return t

    def shard_tensor(self, name: str, full: Tensor) -> Tensor:
        return full

    def barrier(self) -> None:
        pass

    def all_same(self, t: Tensor) -> bool:
        return True


def micro_batches(sequences: list[Tensor], start: int, stop: int, max_tokens: int) -> list[tuple[int, int]]:
    """Sequences [start, stop) cut in order into runs of at most `max_tokens` tokens (at least one
    sequence each): [(first, stop), ...]."""
    out, first, tokens = [], start, 0
    for i in range(start, stop):
        n = sequences[i].numel()
        if i > first and tokens + n > max_tokens:
            out.append((first, i))
            first, tokens = i, 0
        tokens += n
    if stop > first:
        out.append((first, stop))
    return out


class Trainer:
    """Runs windows over a PackedDataset; `step()` is one optimizer step.

    sync: how the run is spread over processes (lockstep.dist.Parallel under torchrun; default one
    process). layout_invariant=False reduces gradients in the order used before the unit trees
    (autograd's sum over micro-batches): for backends whose ops take no part in the trees (eager,
    reference), one process only; the update then depends on the micro-batch size."""

    def __init__(self, model: Transformer, data: PackedDataset, cfg: TrainConfig, sync=None,
                 layout_invariant: bool = True):
        cfg.validate()
        self.model, self.data, self.cfg = model, data, cfg
        self.sync = sync if sync is not None else SingleProcess()
        if not layout_invariant and self.sync.world > 1:
            raise ValueError("layout_invariant: False needs one process; data and tensor parallelism complete the "
                             "unit trees")
        self.layout_invariant = layout_invariant
        self.named = [(n, p) for n, p in model.named_parameters()]
        self.parts = reduction_parts(model)
        self.opt = AdamW(self.named, AdamWConfig(cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay),
                         master_weights=cfg.master_weights)
        self.step_idx = 0
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.grads: dict[str, Tensor] = {}

    @property
    def layout(self) -> dict:
        """How a window is spread: data- and tensor-parallel sizes, micro-batch tokens and this
        rank's micro-batches per window (none of it changes a bit of the run)."""
        units = self.cfg.window_sequences(self.sync.dp_size)
        start, stop = share_of(units, self.sync.dp_rank, self.sync.dp_size)
        per = max(1, self.cfg.micro_batch_tokens // self.cfg.seq_len)
        return {"data_parallel": self.sync.dp_size, "tensor_parallel": self.sync.tp_size,
                "micro_batch_tokens": self.cfg.micro_batch_tokens, "accum": -(-(stop - start) // per)}

    def window(self) -> list[Tensor]:
        """The next window's sequences (every rank draws the whole window)."""
        return self.data.take(self.cfg.window_sequences(self.sync.dp_size))

    def accumulate(self, window: list, masks: list | None = None) -> tuple[float, int]:
        """The gradients of the window's loss (the token-mean over the whole window) into
        `self.grads` ({name: fp32 tensor}). Returns (loss, trained tokens).

        window: the window's sequences in order (a list of micro-batches is flattened: the trainer
        cuts its share into micro-batches of cfg.micro_batch_tokens itself); masks: for each
        sequence, [len - 1] bool marking the targets that count."""
        sequences = sequences_of(window)
        masks = sequences_of(masks) if masks is not None else [torch.ones(s.numel() - 1, dtype=torch.bool) for s in sequences]
        if len(masks) != len(sequences):
            raise ValueError(f"masks: expected one per sequence ({len(sequences)}), got {len(masks)}")
        total_tokens = sum(int(m.sum()) for m in masks)
        if total_tokens == 0:
            raise ValueError("window: no trained tokens (every target is ignored)")
        start, stop = self.sync.share(len(sequences))
        for _, p in self.named:
            p.grad = None
        if not self.layout_invariant:
            return self._accumulate_autograd(sequences, masks, total_tokens)
        trees = grad_tree.UnitTrees(self.named)
        aux = RouterAuxLoss.of(self.model, masks)
        with trees.active():
            for first, last in micro_batches(sequences, start, stop, self.cfg.micro_batch_tokens):
                trees.next_micro_batch()
                with record_router_logits() as router_logits:
                    lp, _ = token_logprobs(self.model, sequences[first:last], first)
                mask = torch.cat(masks[first:last]).to(lp.device)
                units = list(zip(range(first, last), torch.split(lp.detach(), [s.numel() - 1 for s in sequences[first:last]])))
                if aux is None:
                    lp.backward(mask.to(lp.dtype) * (-1.0 / total_tokens))
                    for unit, part in units:
                        trees.add_loss(unit, -row_sum(part[masks[unit].to(part.device)]))
                    continue
                terms = aux.per_unit(router_logits, [s.numel() for s in sequences[first:last]],
                                     [bool(m.any()) for m in masks[first:last]])
                live = [t for t in terms if t.requires_grad]
                torch.autograd.backward([lp] + live, [mask.to(lp.dtype) * (-1.0 / total_tokens)]
                                        + [torch.tensor(aux.weight, dtype=t.dtype) for t in live])
                for (unit, part), term in zip(units, terms):
                    # The unit's share of the window's loss, in token-sum units like the rest.
                    trees.add_loss(unit, -row_sum(part[masks[unit].to(part.device)])
                                   + term.detach() * (aux.weight * total_tokens))
        stray = [n for n, p in self.named if p.grad is not None]
        if stray:
            from .registry import current_backend

            raise RuntimeError(f"layout-invariant training: the gradient of {stray[0]} came from an op outside the unit "
                               f"trees (backend {current_backend()!r}); train on the portable or triton backend, or pass "
                               "layout_invariant=False")
        totals, loss_sum = self.sync.complete(trees, len(sequences))
        params = dict(self.named)
        self.grads = grad_tree.combine(totals, params, self.sync.gather_rows)
        return float(loss_sum) / total_tokens, total_tokens

    def _accumulate_autograd(self, sequences, masks, total_tokens):
        loss_sum = 0.0
        for first, last in micro_batches(sequences, 0, len(sequences), self.cfg.micro_batch_tokens):
            loss, _ = cross_entropy_sum(self.model, sequences[first:last], masks[first:last])
            (loss / total_tokens).backward()
            loss_sum += float(loss.detach())
        self.grads = {n: p.grad.to(_grad_dtype(p)) for n, p in self.named if p.grad is not None}
        return loss_sum / total_tokens, total_tokens

    def step(self, window: list | None = None, masks: list | None = None) -> dict:
        """One window: the gradients of every sequence, clipping by the global norm, one AdamW step."""
        window = window if window is not None else self.window()
        loss_value, total_tokens = self.accumulate(window, masks)
        if not math.isfinite(loss_value):
            raise NonFiniteLoss(f"non-finite loss {loss_value} at step {self.step_idx} "
                                f"(data epoch {self.data.epoch}, sequence index {self.data.index})")
        norm = grad_norm(self.grads, self.parts, self.sync.gather_parts)
        scale = 1.0
        if self.cfg.grad_clip > 0 and float(norm) > self.cfg.grad_clip:
            scale = self.cfg.grad_clip / (float(norm) + 1e-6)
        lr = lr_at(self.step_idx, self.cfg.lr, self.cfg.warmup, self.cfg.steps, self.cfg.min_lr_ratio)
        self.opt.step(lr, grad_scale=scale, grads=self.grads)
        self.step_idx += 1
        return {"step": self.step_idx, "loss": loss_value, "grad_norm": float(norm), "lr": lr, "tokens": total_tokens}

    # --- checkpoints --------------------------------------------------------------------------
    def settings(self) -> dict:
        """What defines this run, as a checkpoint records it: the training config, the compute dtype,
        the data (a fingerprint of its sequences and order), the window in sequences, and the
        layout (which a resumed run may change)."""
        return {"train_config": asdict(self.cfg), "dtype": str(self.model.dtype).removeprefix("torch."),
                "data": self.data.fingerprint(), "window": self.cfg.window_sequences(self.sync.dp_size),
                "layout": self.layout}

    def full_state(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(parameters, optimizer state) whole, gathered from the tensor-parallel ranks: a
        checkpoint holds no rank's shard. Every rank must call it."""
        params = {n: self.sync.full_tensor(n, p.detach()) for n, p in self.named}
        state = {}
        for key, t in self.opt.state_tensors().items():
            state[key] = self.sync.full_tensor(key.split(".", 1)[1], t)
        return params, state

    def save(self, out_dir: str) -> str:
        """Write out_dir/step-NNNNNN atomically and point out_dir/latest at it. Every rank calls
        it; rank 0 writes (every data-parallel rank holds the same bits, and shards are gathered)."""
        from safetensors.torch import save_file

        params, state_tensors = self.full_state()
        name = f"step-{self.step_idx:06d}"
        final = os.path.join(out_dir, name)
        if self.sync.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            tmp = os.path.join(out_dir, f".tmp-{name}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            self.model.save(tmp, tensors=params)
            save_file({k: v.contiguous() for k, v in state_tensors.items()}, os.path.join(tmp, "optimizer.safetensors"))
            settings = self.settings()
            state = {"step": self.step_idx, "data": self.data.state(), "rng": self.rng.get_state().tolist(),
                     "model_fingerprint": model_fingerprint(self.model.config), "train_config": settings["train_config"],
                     "dtype": settings["dtype"], "data_fingerprint": settings["data"], "window": settings["window"],
                     "layout": settings["layout"]}
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state, f)
            for f_name in os.listdir(tmp):
                with open(os.path.join(tmp, f_name), "rb") as f:
                    os.fsync(f.fileno())
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp = os.path.join(out_dir, ".latest.tmp")
            with open(latest_tmp, "w") as f:
                f.write(name)
                f.flush()
                os.fsync(f.fileno())
            os.replace(latest_tmp, os.path.join(out_dir, "latest"))
        self.sync.barrier()
        return final

    def resume(self, out_dir: str) -> int:
        """Load out_dir/latest, at this trainer's layout whatever the checkpoint's; returns the step.
        Refuses a checkpoint of another model, and a change of any setting that defines the run
        (`changes_from` says which); the allowed changes, the layout's included, are kept in
        `self.resumed_changes`."""
        path = latest_checkpoint(out_dir)
        state = read_json(os.path.join(path, "trainer_state.json"), "trainer_state.json")
        if state.get("model_fingerprint") != model_fingerprint(self.model.config):
            raise ValueError(f"resume: checkpoint {path} belongs to another model (config fingerprint "
                             f"{state.get('model_fingerprint')}, this model {model_fingerprint(self.model.config)})")
        self.resumed_changes = self.changes_from(state, path)
        weights = {}
        for f in safetensors_files(path):
            weights.update(read_tensors(f))
        optimizer = read_tensors(os.path.join(path, "optimizer.safetensors"))
        try:
            with torch.no_grad():
                for n, p in self.named:
                    p.copy_(self.sync.shard_tensor(n, weights[n]))
            shards = {k: self.sync.shard_tensor(k.split(".", 1)[1], v) for k, v in optimizer.items()}
            self.opt.load_state_tensors(shards, state["step"])
            self.data.load_state(state["data"])
            self.rng.set_state(torch.tensor(state["rng"], dtype=torch.uint8))
        except (KeyError, TypeError, RuntimeError) as e:
            raise ValueError(f"resume: checkpoint {path} is incomplete or damaged ({type(e).__name__}: {e})") from None
        self.step_idx = state["step"]
        return self.step_idx

    def changes_from(self, state: dict, path: str = "the checkpoint") -> dict:
        """The settings that differ between a checkpoint's `state` and this trainer, as
        {name: [old, new]}, the layout's included. Raises ValueError, naming the setting and both
        values, when one that defines the run differs (RESUMABLE lists the settings that may)."""
        now = self.settings()
        old_cfg = state.get("train_config", {})
        changes, refused = {}, []
        for name, new in now["train_config"].items():
            if name not in old_cfg:
                continue
            old = old_cfg[name]
            if isinstance(new, (list, tuple)):            # JSON gives lists where the config has tuples
                old, new = list(old), list(new)
            if old == new:
                continue
            if name in RESUMABLE:
                changes[name] = [old, new]
            else:
                refused.append((name, old, new))
        for name, key in (("dtype", "dtype"), ("data", "data_fingerprint"), ("window", "window")):
            if key in state and state[key] != now[name]:
                refused.append((name, state[key], now[name]))
        if state.get("layout") is not None and state["layout"] != now["layout"]:
            changes["layout"] = [state["layout"], now["layout"]]
        if any(n == "window" for n, _, _ in refused):
            why = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items() if k in RESUMABLE[3:])
            refused = [(f"window (sequences per step; {why or 'the data-parallel size'} changed it, and the "
                        f"layout may change only with the window kept: ranks x accum x micro_batch_tokens, or "
                        f"global_batch_tokens)" if n == "window" else n, o, v) for n, o, v in refused]
        if refused:
            what = "; ".join(f"{n}: {o!r} in the checkpoint, {v!r} now" for n, o, v in refused)
            raise ValueError(f"resume: {path} was written with other settings ({what}). A resumed run keeps the "
                             f"settings that define it; start a new run in another --out to change them")
        return changes

    def params_hash(self) -> str:
        """sha256 of this rank's parameters (its shards under tensor parallelism), by name."""
        h = hashlib.sha256()
        for n, p in sorted(self.named, key=lambda kv: kv[0]):
            h.update(n.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def latest_checkpoint(out_dir: str) -> str:
    """The folder out_dir/latest points at; errors name what is missing or damaged."""
    latest = os.path.join(out_dir, "latest")
    if not os.path.exists(latest):
        raise FileNotFoundError(f"resume: no checkpoint in {out_dir} (no 'latest' file)")
    with open(latest, errors="replace") as f:
        name = f.read().strip()
    path = os.path.join(out_dir, name)
    if not re.fullmatch(r"step-\d{6}", name) or not os.path.isdir(path):
        raise ValueError(f"resume: {latest} names {name!r}, which is not a checkpoint folder in {out_dir}")
    return path


def make_model_and_tokens(model_arg: str, data_path: str, dtype: torch.dtype, seed: int) -> tuple[Transformer, list[int]]:
    """Load (or build the tiny) model and tokenize the data; token ids beyond the vocab are refused."""
    model = model_from_source(model_arg, dtype, "llama", seed, vocab_size=320)
    if model.tokenizer is None:                   # the tiny model: the built-in byte tokenizer
        model.tokenizer = load_tokenizer(None)
    tokenizer = model.tokenizer
    texts = read_texts(data_path)
    tokens: list[int] = []
    for t in texts:
        ids = tokenizer.encode(t)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.append(tokenizer.eos_token_id)
        tokens.extend(ids)
    too_big = [t for t in tokens if t >= model.config.vocab_size]
    if too_big:
        raise ValueError(f"data: the tokenizer produces id {max(too_big)}, beyond the model's vocabulary of "
                         f"{model.config.vocab_size} (tokenizer/model mismatch); refusing to train")
    return model, tokens


# What `lockstep train` writes into its output folder (and all that --overwrite may delete).
RUN_FILES = re.compile(r"(step-\d{6}|\.tmp-step-\d{6}(-\d+)?|latest|\.latest\.tmp|log\.jsonl(\.tmp)?|\.log-rank\d+\.jsonl)")


def prepare_out(out: str, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run in a folder that holds one, unless `overwrite` (which deletes only
    what a run writes, and refuses a folder that holds anything else)."""
    if resume or not os.path.isdir(out) or not os.listdir(out):
        return
    entries = sorted(os.listdir(out))
    if not overwrite:
        raise ValueError(f"out: {out} is not empty ({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''}); "
                         "pass --resume to continue the run in it, or --overwrite to start over")
    foreign = [e for e in entries if not RUN_FILES.fullmatch(e)]
    if foreign:
        raise ValueError(f"out: {out} holds files that lockstep train did not write ({', '.join(foreign[:4])}); "
                         "refusing to overwrite it")
    for e in entries:
        path = os.path.join(out, e)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def read_log(out: str) -> tuple[list[dict], list[dict]]:
    """A run folder's log.jsonl as (step records, event records): one step record per optimizer step
    (step, loss, grad_norm, lr, tokens, seconds) and an event record at each start and resume
    (ranks, accum, global batch, layout, the settings a resume changed)."""
    steps, events = [], []
    with open(os.path.join(out, "log.jsonl"), errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            (events if "event" in rec else steps).append(rec)
    return steps, events


def truncate_log(log_path: str, step: int) -> int:
    """Keep the records of log.jsonl up to `step` (those of a resumed checkpoint); returns how many
    step records were dropped. Rewritten through a temporary file, so a crash never loses it."""
    if not os.path.exists(log_path):
        return 0
    kept, dropped = [], 0
    with open(log_path, errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1                      # a line cut short by a kill
                continue
            if "step" in rec and "event" not in rec and rec["step"] > step:
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = log_path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, log_path)
    return dropped


def run(model: str, data: str, out: str, cfg: TrainConfig, dtype: torch.dtype = torch.float32,
        resume: bool = False, overwrite: bool = False, progress: bool = True, tensor_parallel: int = 1) -> dict:
    """Train `model` ("tiny" or a checkpoint folder) on the text at `data`, writing checkpoints and
    log.jsonl to `out`; under torchrun, data parallel over world / tensor_parallel groups of
    `tensor_parallel` ranks each.

    The window of a step is cfg.global_batch_tokens tokens (or ranks x cfg.accum micro-batches of
    cfg.micro_batch_tokens tokens); it is printed at the start and logged with the layout. Every
    layout trains the same bits, and `resume` continues at another one. Returns a summary (first and
    last step record, checkpoint path, log path). Raises ValueError or OSError on bad input before
    any step, NonFiniteLoss when the loss stops being finite (the last good checkpoint is kept)."""
    from . import dist as ldist

    distributed = ldist.init_from_env()
    rank = int(os.environ.get("RANK", "0")) if distributed else 0
    try:
        cfg.validate()
        if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel: expected a positive int, got {tensor_parallel!r}")
        world = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
        if world % tensor_parallel:
            raise ValueError(f"tensor_parallel: {tensor_parallel} does not divide the {world} "
                             f"rank{'s' if world > 1 else ''}; start torchrun with a multiple of it")
        failure = None
        if rank == 0:
            try:
                prepare_out(out, resume, overwrite)
            except (ValueError, OSError) as e:
                failure = e
        if distributed:                   # every rank stops when rank 0 refuses the folder
            flag = torch.tensor([float(failure is not None)])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item() and failure is None:
                raise ValueError(f"out: rank 0 refused {out} (its error says why)")
        if failure is not None:
            raise failure
        network, tokens = make_model_and_tokens(model, data, dtype, cfg.seed)
        sync = None
        if distributed:
            ldist.check_consistent(network, asdict(cfg) | {"model": repr(network.config), "tp": tensor_parallel})
            ldist.initialize_model_parallel(tensor_parallel)
            if tensor_parallel > 1:
                ldist.tensor_parallel(network)
            sync = ldist.Parallel(network)
        trainer = Trainer(network, PackedDataset(tokens, cfg.seq_len, cfg.micro_batch_tokens, cfg.seed), cfg, sync)
        if resume:
            trainer.resume(out)
        return _train_loop(out, cfg, trainer, rank, progress, resumed=resume)
    finally:
        if distributed:
            torch.distributed.destroy_process_group()


def _train_loop(out: str, cfg: TrainConfig, trainer: Trainer, rank: int, progress: bool, resumed: bool) -> dict:
    """Steps, progress, JSONL log and checkpoints; rank 0 alone writes (every rank holds the same bits)."""
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "log.jsonl")
    layout = trainer.layout
    window = cfg.window_sequences(layout["data_parallel"])
    start = {"event": "resume" if resumed else "start", "step": trainer.step_idx, "ranks": trainer.sync.world,
             "data_parallel": layout["data_parallel"], "tensor_parallel": layout["tensor_parallel"],
             "accum": layout["accum"], "micro_batch_tokens": cfg.micro_batch_tokens,
             "global_batch_tokens": window * cfg.seq_len, "layout": layout}
    if resumed:
        start["changes"] = getattr(trainer, "resumed_changes", {})
    if rank == 0:
        start["dropped_log_records"] = truncate_log(log_path, trainer.step_idx) if resumed else 0
        dp, accum = layout["data_parallel"], layout["accum"]
        tp = f", tensor-parallel size {layout['tensor_parallel']}" if layout["tensor_parallel"] > 1 else ""
        print(f"lockstep train: global batch {window} sequences x {cfg.seq_len} tokens = {start['global_batch_tokens']} "
              f"tokens per step ({dp} data-parallel rank{'s' if dp > 1 else ''} x {accum} micro-batch"
              f"{'es' if accum > 1 else ''} of up to {cfg.micro_batch_tokens} tokens{tp})"
              + (f"; resumed at step {trainer.step_idx}" if resumed else "")
              + "".join(f"; {k} {a} -> {b}" for k, (a, b) in start.get("changes", {}).items()), file=sys.stderr)
    started = time.time()
    first = last = None
    seen_tokens = 0
    log = open(log_path, "a") if rank == 0 else None
    try:
        if log:
            log.write(json.dumps(start) + "\n")
            log.flush()
        while trainer.step_idx < cfg.steps:
            rec = trainer.step()
            rec["seconds"] = round(time.time() - started, 3)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            first = first or rec
            last = rec
            seen_tokens += rec["tokens"]
            rate = seen_tokens / max(1e-9, time.time() - started)
            done = rec["step"] / cfg.steps
            bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
            if rank == 0 and progress:
                print(f"\r[{bar}] step {rec['step']}/{cfg.steps} loss {rec['loss']:.4f} "
                      f"grad_norm {rec['grad_norm']:.3f} {rate:.0f} tok/s", end="", file=sys.stderr, flush=True)
            if cfg.save_every and rec["step"] % cfg.save_every == 0:
                trainer.save(out)
    finally:
        if log:
            log.close()
    if rank == 0 and progress and first is not None:
        print(file=sys.stderr)
    trainer.save(out)
    return {"rank": rank, "step": trainer.step_idx, "first": first, "last": last,
            "checkpoint": os.path.join(out, f"step-{trainer.step_idx:06d}"), "log": log_path,
            "seconds": time.time() - started}
