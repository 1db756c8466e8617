"""lockstep.train.sharded: AdamW with its state sharded over the data-parallel ranks (ZeRO stage 1).

The partition (docs/adr/0037): the parameters in AdamW's order (by name), each flattened in its
own (row-major) order and laid end to end, form one sequence of N elements; data-parallel rank r
of D owns the contiguous range [r * S, min((r + 1) * S, N)), S = ceil(N / D). It is a pure function
of the parameters' names and shapes and of D, the same on every rank, and cuts a tensor wherever a
range ends.

A rank keeps AdamW's state (both moments, and the fp32 master weights where there are some) for the
elements it owns, and updates them alone. AdamW is elementwise, and every scalar of its step (the
learning rate, the bias corrections, the clipping factor of the global gradient norm, which every
rank computes from the whole gradients as before) is the same on every rank, so an owner computes
the bits of the unsharded update. The updated parameters are then all-gathered as bytes: every
rank holds the whole model again, a copy of the owners' bits.

The Trainer builds a `ShardedAdamW` for `TrainConfig.shard_optimizer` at a data-parallel size
above 1 (at size 1 the one rank owns every element: the optimizer is lockstep.train.optim.AdamW).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from ..numerics.chunks import row_chunks
from ..numerics.cpu_kernels import CpuKernels
from ..numerics.fixed_order import accumulate_dtype, ceil_div
from .optim import AdamW, AdamWConfig

STATE_KINDS = ("exp_avg", "exp_avg_sq", "master")


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of parameter `name`, flattened in row-major order."""
    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def partition(shapes: list[tuple[str, tuple[int, ...]]], ranks: int) -> list[list[Piece]]:
    """The pieces each of `ranks` data-parallel ranks owns, in rank order: the parameters
    (name, shape) sorted by name and flattened end to end, cut into `ranks` contiguous ranges of
    ceil(N / ranks) elements (the last ones shorter, possibly empty). Every element belongs to
    exactly one rank; a rank's pieces are in the flattened order."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks: expected a positive int, got {ranks!r}")
    ordered = sorted(shapes, key=lambda kv: kv[0])
    sizes = [(n, int(torch.Size(s).numel())) for n, s in ordered]
    total = sum(size for _, size in sizes)
    width = max(1, ceil_div(total, ranks))
    owned: list[list[Piece]] = [[] for _ in range(ranks)]
    offset = 0
    for name, size in sizes:
        at = 0
        while at < size:
            r = (offset + at) // width
            stop = min(size, (r + 1) * width - offset)
            owned[r].append(Piece(name, at, stop))
            at = stop
        offset += size
    return owned


class ShardExchange(Protocol):
    """The data-parallel collectives the sharded optimizer needs (lockstep.dist.ParallelSync's)."""

    dp_rank: int
    dp_size: int

    def all_gather_shards(self, mine: Tensor) -> Tensor:
        """[dp * n]: every data-parallel rank's 1-D `mine` ([n]) in rank order, on every rank."""

    def gather_shards(self, mine: Tensor) -> Tensor | None:
        """The same on data-parallel rank 0 alone; None on the others."""


class ShardedAdamW(AdamW):
    """lockstep.train.optim.AdamW whose state this data-parallel rank keeps for its own pieces only
    (`partition`); after each step the ranks exchange the updated parameters (`exchange`).

    exchange: the data-parallel collectives, a lockstep.dist.ParallelSync (or any object with its
    dp_rank, dp_size, all_gather_shards and gather_shards). Every rank must call `step` and
    `state_tensors` together. The state tensors are 1-D: exp_avg[name] is [piece.numel] in the
    accumulation dtype (fp32; float64 for a float64 parameter)."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: AdamWConfig, exchange: ShardExchange,
                 master_weights: bool = False):
        for attr in ("dp_rank", "dp_size", "all_gather_shards", "gather_shards"):
            if not hasattr(exchange, attr):
                raise TypeError(f"shard_optimizer: the sync ({type(exchange).__name__}) has no {attr}; sharding the "
                                "optimizer needs lockstep.dist.ParallelSync's data-parallel collectives")
        self.cfg = cfg
        self.params = sorted(named_params, key=lambda kv: kv[0])
        self.by_name = dict(self.params)
        bad = [n for n, p in self.params if not p.is_contiguous()]
        if bad:
            raise ValueError(f"shard_optimizer: parameter {bad[0]} is not contiguous; the partition cuts flat "
                             "parameters")
        self.exchange = exchange
        self.rank, self.ranks = exchange.dp_rank, exchange.dp_size
        self.owned = partition([(n, tuple(p.shape)) for n, p in self.params], self.ranks)
        self.mine = self.owned[self.rank]
        self.step_count = 0

        def zeros(piece: Piece) -> Tensor:
            p = self.by_name[piece.name]
            return torch.zeros(piece.numel, dtype=accumulate_dtype(p.dtype), device=p.device)

        self.exp_avg = {pc.name: zeros(pc) for pc in self.mine}
        self.exp_avg_sq = {pc.name: zeros(pc) for pc in self.mine}
        self.master = ({pc.name: self._flat(pc).to(accumulate_dtype(self.by_name[pc.name].dtype)).clone()
                        for pc in self.mine} if master_weights else None)

    def _flat(self, piece: Piece) -> Tensor:
        """The parameter's elements of `piece`: a 1-D view into the parameter."""
        return self.by_name[piece.name].data.view(-1)[piece.start:piece.stop]

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0, grads: dict[str, Tensor] | None = None) -> None:
        """AdamW.step on this rank's pieces, then every rank's updated pieces gathered into every
        rank's parameters (a copy of the owner's bits)."""
        super().step(lr, grad_scale, grads)
        self._gather_params()

    def _step_all(self, lr: float, grad_scale: float, grads: dict[str, Tensor] | None, bc1: float,
                  bc2_sqrt: float, kernels: CpuKernels | None) -> None:
        for piece in self.mine:
            p = self.by_name[piece.name]
            grad = p.grad if grads is None else grads.get(piece.name)
            if grad is None:                   # as AdamW: a parameter without a gradient stays
                continue
            g = grad.reshape(-1)[piece.start:piece.stop]
            m, v = self.exp_avg[piece.name], self.exp_avg_sq[piece.name]
            model = self._flat(piece)
            w = self.master[piece.name] if self.master is not None else model
            model = model if self.master is not None else None
            # The same cache-sized chunks as AdamW's, shifted by the piece's start: every op is
            # elementwise, so neither the cut nor the chunks change a bit (tests/test_chunks.py).
            for s, e in row_chunks(piece.numel, 1):
                self._update(g[s:e], m[s:e], v[s:e], w[s:e], None if model is None else model[s:e], lr,
                             grad_scale, bc1, bc2_sqrt, kernels)

    # --- the exchanges ---------------------------------------------------------------------------
    def _pack(self, out: Tensor, pieces: list[Piece], tensors: Callable[[Piece], Tensor]) -> int:
        """The bytes of `tensors(piece)` for each piece, end to end, into the front of `out` (1-D
        uint8); returns how many. The rest of `out` is padding, left as it is."""
        at = 0
        for pc in pieces:
            t = tensors(pc).contiguous().view(torch.uint8)
            out[at:at + t.numel()].copy_(t)
            at += t.numel()
        return at

    def _nbytes(self, pieces: list[Piece], state: bool) -> int:
        """Bytes of the pieces' parameter elements, or (state) of one state tensor's elements."""
        return sum(pc.numel * self._dtype(pc.name, state).itemsize for pc in pieces)

    def _dtype(self, name: str, state: bool) -> torch.dtype:
        """A parameter's dtype, or (state) that of its state: the accumulation dtype."""
        dtype = self.by_name[name].dtype
        return accumulate_dtype(dtype) if state else dtype

    def _gather_params(self) -> None:
        """Every rank's pieces of the parameters, copied bit for bit into this rank's parameters."""
        width = max(self._nbytes(pieces, False) for pieces in self.owned)
        buffer = torch.empty(width, dtype=torch.uint8, device=self.params[0][1].device)
        buffer[self._pack(buffer, self.mine, self._flat):].zero_()     # padding: sent, never read
        every = self.exchange.all_gather_shards(buffer)               # [ranks * width]
        for r, pieces in enumerate(self.owned):
            if r == self.rank:
                continue
            at = r * width
            for pc in pieces:
                target = self._flat(pc)
                n = pc.numel * target.element_size()
                target.view(torch.uint8).copy_(every[at:at + n])
                at += n

    def state_tensors(self) -> dict[str, Tensor]:
        """The whole state tensors ({"kind.name": tensor of the parameter's shape}, as AdamW's) on
        data-parallel rank 0, the checkpoint's writer; {} on the other ranks. Every rank calls it."""
        kinds = [k for k in STATE_KINDS if k != "master" or self.master is not None]
        width = max(self._nbytes(pieces, True) for pieces in self.owned) * len(kinds)
        buffer = torch.zeros(width, dtype=torch.uint8, device=self.params[0][1].device)
        at = 0
        for k in kinds:
            at += self._pack(buffer[at:], self.mine, lambda pc, k=k: getattr(self, k)[pc.name])
        every = self.exchange.gather_shards(buffer)                   # [ranks * width] on rank 0, else None
        if every is None:
            return {}
        out = {f"{k}.{n}": torch.empty(p.shape, dtype=self._dtype(n, True), device=p.device)
               for k in kinds for n, p in self.params}
        for r, pieces in enumerate(self.owned):
            at = r * width
            for k in kinds:
                for pc in pieces:
                    target = out[f"{k}.{pc.name}"].view(-1)[pc.start:pc.stop]
                    n = pc.numel * target.element_size()
                    target.view(torch.uint8).copy_(every[at:at + n])
                    at += n
        return out

    def load_state_tensors(self, tensors: dict[str, Tensor], step: int) -> None:
        """This rank's pieces of whole state tensors (a checkpoint's, written at any data-parallel
        size, sharded or not)."""
        for pc in self.mine:
            for kind in STATE_KINDS:
                held = getattr(self, kind)
                if held is not None:
                    held[pc.name].copy_(tensors[f"{kind}.{pc.name}"].reshape(-1)[pc.start:pc.stop])
        self.step_count = step

    def state_bytes(self) -> int:
        """Bytes of the moments and master weights this rank holds."""
        return state_bytes(self)


def state_bytes(opt: AdamW) -> int:
    """Bytes of the optimizer state (both moments, and master weights where kept) that `opt`, an
    AdamW or a ShardedAdamW, holds on this rank."""
    held = [opt.exp_avg, opt.exp_avg_sq] + ([opt.master] if opt.master is not None else [])
    return sum(t.numel() * t.element_size() for d in held for t in d.values())
