"""lockstep.parity.runs: `lockstep parity`'s configured runs (backend, dtype, layout, chunked or
cached decode) of one target sequence, recorded and compared."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import contract, registry
from ..numerics.fixed_order import ceil_div
from .compare import Comparison, compare
from .recorder import OpRecord, Recorder, RowView, tensor_summary



# The largest batch (layout=batchN) and chunk (layout=chunkN) a parity run takes.
MAX_BATCH = 256


@dataclass
class RunConfig:
    """backend, layout and dtype of one side. backend: "auto" (the default: what lockstep runs on
    the model's device, native on a CPU where it builds) or a backend's name. layout: "alone",
    "batch<N>" (the sequence at position 1 of N sequences, or 0 if N is 1), "chunk<C>" (prefill
    through the KV cache in chunks of C, forward only) or "decode" (token by token from the KV
    cache, forward only)."""

    backend: str = "auto"
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
    from ..model import pack

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
    from ..paged_cache import build_step

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
        digest, mx, norm = tensor_summary(t)
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
