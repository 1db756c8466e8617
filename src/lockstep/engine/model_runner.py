"""One step of the model: the cache inputs of the scheduled sequences, the forward over the paged
cache, and the draw of a token for every sequence whose pending tokens all went through.

A step that only decodes runs on static buffers (DecodeBuffers): its sequences are padded to a
bucket of the batch size, and the step's metadata is copied into that bucket's buffer, so that
every step of a bucket hands the forward the same tensors, with the same shapes. That is what a
CUDA graph captured per bucket replays; padding rows cannot change real rows, since every op is
row-independent (docs/contract.md), and they write only scratch blocks past the engine's own."""

from __future__ import annotations

import dataclasses

import torch

from .. import registry
from ..model import Transformer
from ..numerics.fixed_order import ceil_div
from ..paged_cache import CacheStep, build_step, step_size
from ..rotary import MAX_POSITION, TablePositions
from ..sampling import Draw, sample
from .sequence import Sequence
from .step_graph import StepGraphs


class DecodeBuffers:
    """Per-bucket static step buffers for decode steps of up to `max_num_seqs` sequences of up to
    `max_len` tokens. The buckets are the powers of two below max_num_seqs, and max_num_seqs; padding
    rows decode into scratch blocks numbered from `num_blocks` (`scratch_blocks` of them, which
    the cache must hold beyond the engine's blocks)."""

    def __init__(self, max_num_seqs: int, max_len: int, block_size: int, num_blocks: int):
        self.buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs] + [max_num_seqs]
        self.block_size, self.first_scratch = block_size, num_blocks
        # No sequence outgrows the model's context or the cache: the block table's width, and rope's
        # device table of every position a step may hold (TablePositions; padding rows' below block_size).
        longest = min(max_len, num_blocks * block_size)
        self.width = ceil_div(longest, block_size)
        self.positions_below = min(max(longest, block_size), MAX_POSITION)
        self.scratch_blocks = ceil_div(max_num_seqs, block_size)
        self._flat: dict[int, torch.Tensor] = {}

    def bucket(self, rows: int) -> int:
        """The smallest bucket that holds `rows` decode rows."""
        return next(b for b in self.buckets if b >= rows)

    def padded(self, spans: list, tokens: list[int]) -> tuple[list, list[int]]:
        """spans and tokens with padding rows appended up to the bucket: padding row j decodes
        position j % block_size of scratch block j // block_size (distinct slots), token 0."""
        pad = self.bucket(len(spans)) - len(spans)
        bs = self.block_size
        extra = [([self.first_scratch + j // bs], j % bs, j % bs + 1) for j in range(pad)]
        return spans + extra, tokens + [0] * pad

    def flat(self, rows: int, device: torch.device) -> torch.Tensor:
        """The bucket's buffer (made on first use): build_step's flat layout for `rows` decode rows."""
        buffer = self._flat.get(rows)
        if buffer is None or buffer.device != device:
            buffer = self._flat[rows] = torch.empty(step_size(rows, rows, self.width), dtype=torch.int64,
                                                    device=device)
        return buffer


def unremembered(step: CacheStep) -> CacheStep:
    """The same step (the same tensors and host values) without what its first forward remembered
    of its values (rope's gathered angles): a graph captured from it must record the ops that
    compute those, so that a replay computes them from the buffer's new values."""
    host = step.host
    fresh = dataclasses.replace(host, positions=TablePositions(host.positions.tensor, host.positions.limit))
    return dataclasses.replace(step, host=fresh)


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int, max_num_seqs: int | None = None,
                 max_len: int | None = None, cuda_graphs: bool = False, cpu_graphs: bool = False):
        """With max_num_seqs and max_len, decode steps run on static buffers (DecodeBuffers); with
        cuda_graphs as well, each bucket's decode forward is captured in a CUDA graph on its first
        step and replayed after; with cpu_graphs, on the CPU, each bucket's decode forward is
        captured on its second step and replayed after, where it can be (step_graph.py)."""
        self.model, self.block_size = model, block_size
        self.decode = DecodeBuffers(max_num_seqs, max_len, block_size, num_blocks) if max_num_seqs else None
        scratch = self.decode.scratch_blocks if self.decode else 0
        self.cache = model.allocate_kv_cache(num_blocks + scratch, block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.cuda_graphs = cuda_graphs and self.decode is not None
        self.step_graphs = StepGraphs() if cpu_graphs and self.decode is not None else None

    def _decode_forward(self, step, positions) -> torch.Tensor:
        """The forward of a static decode step: eager, or its bucket's graph. A bucket's first step
        runs eagerly (which compiles the kernels and builds rope's table and the decode blocks, so
        that nothing is copied from the host while capturing), then is captured; later steps of the
        bucket copy their metadata into the same buffer (build_step) and replay."""
        ids = step.host.input_ids
        if not self.cuda_graphs:
            if self.step_graphs is None or ids.device.type != "cpu":
                return self.model.forward_cached(ids, positions, step, self.cache)
            return self.step_graphs.forward(
                ids.shape[0], lambda: self.model.forward_cached(ids, positions, step, self.cache),
                lambda: self.model.forward_cached(ids, positions, unremembered(step), self.cache), self.model,
                self.cache)
        rows = ids.shape[0]
        entry = self.graphs.get(rows)
        if entry is not None:
            entry[0].replay()
            return entry[1]
        kernel = registry.resolve("paged_attention", ids.device)
        if not kernel.__module__.startswith("lockstep.backends.triton"):
            raise RuntimeError(f"cuda_graphs: the decode step's attention runs on {kernel.__module__}, which reads "
                               "its step on the host; CUDA graphs need the Triton backend's (use_backend('triton') "
                               "or 'auto')")
        hidden = self.model.forward_cached(ids, positions, step, self.cache)
        torch.cuda.synchronize(ids.device)
        graph = torch.cuda.CUDAGraph()
        # Capturing records the kernels without running them: the cache writes happened above. The
        # buckets share one memory pool, which holds because each output is read before the next
        # replay; other threads may use the device meanwhile (thread_local).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.model.forward_cached(ids, positions, unremembered(step), self.cache)
        self._pool = graph.pool()
        self.graphs[rows] = (graph, out)
        return hidden

    def run(self, plan: list[tuple[Sequence, int]]) -> list[tuple[Sequence, Draw]]:
        """Compute the planned tokens (advancing each sequence's `computed`) and draw the next token of
        the sequences that are now up to date."""
        device = self.model.device
        spans = [(seq.blocks, seq.computed, seq.computed + n) for seq, n in plan]
        tokens = [t for seq, n in plan for t in seq.tokens[seq.computed:seq.computed + n]]
        vocab = self.model.config.vocab_size
        static = self.decode is not None and len(tokens) == len(plan)
        if static:
            spans, tokens = self.decode.padded(spans, tokens)
            step, positions = build_step(spans, self.block_size, device, tokens, vocab, width=self.decode.width,
                                         into=self.decode.flat(len(spans), device),
                                         positions_below=self.decode.positions_below)
        else:
            step, positions = build_step(spans, self.block_size, device, tokens, vocab)
        with torch.no_grad():
            if static:
                hidden = self._decode_forward(step, positions)
            else:
                hidden = self.model.forward_cached(step.host.input_ids, positions, step, self.cache)
            rows, ready = [], []
            for i, (seq, n) in enumerate(plan):
                seq.computed += n
                if seq.remaining == 0:
                    rows.append(step.host.cu_seqlens_q[i + 1] - 1)
                    ready.append(seq)
            if not ready:
                return []
            seen = [_seen(s.tokens, vocab, device) if s.params.repetition_penalty != 1.0 else None for s in ready]
            draws = sample(hidden[rows], self.model.lm_head_weight, [s.params for s in ready],
                           [s.computed for s in ready], [s.index for s in ready], seen,
                           softcap=self.model.config.final_logit_softcapping)
        return list(zip(ready, draws))


def _seen(tokens: list[int], vocab: int, device) -> torch.Tensor:
    """A bool mask [vocab] of the tokens that occur in `tokens`."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(tokens, dtype=torch.int64, device=device)] = True
    return mask
