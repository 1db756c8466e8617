"""lockstep.train.optim: AdamW, the global gradient norm, clipping and the learning-rate schedule.

AdamW with decoupled weight decay and bias correction, built from basic elementwise ops in a fixed
order. The global gradient norm: each tensor's sum of squares in its accumulation dtype (fp32;
float64 for float64) by the fixed-order `row_sum`, then the tensors in parameter order, totalled in
float64 where any gradient is float64. Warmup then cosine schedule. fp32 master weights are optional
when the model computes in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..numerics.chunks import row_chunks
from ..numerics.exact_math import cos, power
from ..numerics.fixed_order import accumulate_dtype, row_sum, sqrt, tree_sum
from ..numerics.cpu_kernels import CpuKernels
from ..registry import cpu_backend_kernel_set


@dataclass
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        check_betas_and_eps(self.betas, self.eps)


def check_betas_and_eps(betas: tuple[float, float], eps: float) -> None:
    """A ValueError naming `betas` unless they are two numbers in [0, 1), or `eps` unless positive."""
    if not (len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"betas: expected two numbers in [0, 1), got {betas!r}")
    if not eps > 0:
        raise ValueError(f"eps: expected a positive number, got {eps!r}")


class AdamW:
    """AdamW in a fixed order of elementwise ops, over named parameters in name order.

    The state and the arithmetic are in the accumulation dtype: fp32, float64 for a float64
    parameter (whose update rounded to fp32 would lose the precision it is kept for). With
    `master_weights`, the optimizer keeps copies in that dtype and writes rounded values back into
    the (bf16) model after every step."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: AdamWConfig, master_weights: bool = False):
        self.cfg = cfg
        self.params = sorted(named_params, key=lambda kv: kv[0])
        self.step_count = 0
        self.master = ({n: p.detach().to(accumulate_dtype(p.dtype)).clone() for n, p in self.params}
                       if master_weights else None)
        self.exp_avg = {n: torch.zeros(p.shape, dtype=accumulate_dtype(p.dtype), device=p.device)
                        for n, p in self.params}
        self.exp_avg_sq = {n: torch.zeros(p.shape, dtype=accumulate_dtype(p.dtype), device=p.device)
                           for n, p in self.params}

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0, grads: dict[str, Tensor] | None = None) -> None:
        """One update from `grads` ({name: gradient}, any float dtype; default: each p.grad).
        A parameter without a gradient is left as it is."""
        self.step_count += 1
        b1, b2 = self.cfg.betas
        bc1 = 1 - power(b1, self.step_count)       # the C library's pow follows the CPU (exact_math)
        bc2_sqrt = math.sqrt(1 - power(b2, self.step_count))
        # The denominator's sqrt on the CPU backend's kernels: torch.sqrt's bits follow the CPU.
        self._step_all(lr, grad_scale, grads, bc1, bc2_sqrt, cpu_backend_kernel_set())

    def _step_all(self, lr: float, grad_scale: float, grads: dict[str, Tensor] | None, bc1: float,
                  bc2_sqrt: float, kernels: CpuKernels | None) -> None:
        for name, p in self.params:
            grad = p.grad if grads is None else grads.get(name)
            if grad is None:
                continue
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            w = self.master[name] if self.master is not None else p.data
            model = p.data if self.master is not None else None
            if not w.is_contiguous() or (model is not None and not model.is_contiguous()):
                self._update(grad, m, v, w, model, lr, grad_scale, bc1, bc2_sqrt, kernels)
                continue
            # Flat cache-sized chunks: the update is elementwise, so the bits are those of the
            # whole-tensor chain (tests/test_chunks.py), at a fraction of its memory traffic.
            flat = [None if t is None else t.view(-1) for t in (m, v, w, model)]
            grad = grad.reshape(-1)
            for s, e in row_chunks(grad.numel(), 1):
                self._update(grad[s:e], *(None if t is None else t[s:e] for t in flat), lr, grad_scale, bc1, bc2_sqrt,
                             kernels)

    def _update(self, grad: Tensor, m: Tensor, v: Tensor, w: Tensor, model: Tensor | None, lr: float,
                grad_scale: float, bc1: float, bc2_sqrt: float, kernels: CpuKernels | None) -> None:
        """The AdamW update of one tensor or chunk, in place on m and v (the accumulation dtype) and on
        the weights w (the model's, or master weights whose rounded values are then written into
        `model`); the square root on the CPU kernels `kernels`."""
        b1, b2 = self.cfg.betas
        acc = m.dtype
        # One IEEE op per line, in place where the result is not needed twice: the same bits as the
        # expression form, without an allocation for every op.
        g = grad.to(acc)
        if grad_scale != 1.0:
            g = g * grad_scale
        tmp = g * (1 - b1)
        m.mul_(b1).add_(tmp)                                       # m * b1 + g * (1 - b1)
        torch.mul(g, g, out=tmp).mul_(1 - b2)
        v.mul_(b2).add_(tmp)                                       # v * b2 + (g * g) * (1 - b2)
        wf = w if w.dtype == acc else w.to(acc)
        if self.cfg.weight_decay:
            wf.mul_(1 - lr * self.cfg.weight_decay)
        sqrt(v, out=tmp, kernels=kernels).div_(bc2_sqrt).add_(self.cfg.eps)        # denom
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
    """Global L2 norm of gradients {name: tensor}, a 0-d fp32 tensor (float64 where any gradient is
    float64), in a fixed order: parameters by name, each one's sum of squares by `square_sum`.

    parts[name] = (dim, k) sums a parameter's squares in k slices along dim, combined by the
    canonical tree: the slices tensor parallelism shards, so that every tensor-parallel size sums
    the same slices. Under tensor parallelism, `gather` turns this rank's [n] slice sums into every
    rank's ([tp, n], rank order); replicated parameters are counted once."""
    parts = parts or {}
    names = sorted(n for n, g in grads.items() if g is not None)
    acc = torch.float64 if any(grads[n].dtype == torch.float64 for n in names) else torch.float32
    split = [n for n in names if n in parts]
    local = []
    for n in split:
        dim, k = parts[n]
        size = grads[n].shape[dim] // k
        local += [square_sum(grads[n].narrow(dim, i * size, size)).to(acc) for i in range(k)]
    gathered = None
    if local:
        mine = torch.stack(local).cpu()
        gathered = gather(mine) if gather is not None else mine[None]
    total = torch.zeros((), dtype=acc)
    offset = 0
    for n in names:
        if n in parts:
            k = parts[n][1]
            total = total + tree_sum(list(gathered[:, offset:offset + k].reshape(-1)))
            offset += k
        else:
            total = total + square_sum(grads[n]).cpu().to(acc)
    return sqrt(total, kernels=cpu_backend_kernel_set())


def square_sum(grad: Tensor) -> Tensor:
    """The sum of squares of a gradient (any float dtype), a 0-d tensor of its accumulation dtype
    (fp32; float64 for float64): each square in that dtype, `row_sum` over the last dimension, then
    over the row sums (for 0-d and 1-d tensors, one row_sum). A fixed order that depends on the shape
    alone, vectorised over rows (a flat row_sum of a vocabulary-sized table is a Python loop of its
    length / SUM_WIDTH steps), and squared in cache-sized row chunks (lockstep.numerics.chunks), which changes
    no bit."""
    grad = grad.detach()
    acc = accumulate_dtype(grad.dtype)
    if grad.dim() < 2:
        return row_sum(grad.to(acc).square().reshape(1, -1))[0]
    rows = grad.reshape(-1, grad.shape[-1])
    sums = torch.empty(rows.shape[0], dtype=acc, device=grad.device)
    for s, e in row_chunks(rows.shape[0], rows.shape[1]):
        sums[s:e] = row_sum(rows[s:e].to(acc).square())
    return row_sum(sums[None])[0]


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup for `warmup` steps, then cosine decay to min_lr_ratio * base_lr at `total`
    (the cosine of lockstep.numerics.exact_math: the C library's follows the CPU)."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(math.pi * progress)))



def clip_scale(norm: Tensor | float, max_norm: float) -> float:
    """The factor that brings a global gradient norm down to `max_norm` (1.0 when it is within it,
    or when max_norm is 0: clipping off)."""
    if max_norm > 0 and float(norm) > max_norm:
        return max_norm / (float(norm) + 1e-6)
    return 1.0
