"""One step of the model: the cache inputs of the scheduled sequences, the forward over the paged
cache, and the draw of a token for every sequence whose pending tokens all went through."""

from __future__ import annotations

import torch

from ..model import Transformer
from ..paged_cache import build_step
from ..sampling import Draw, sample
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int):
        self.model, self.block_size = model, block_size
        self.cache = model.allocate_kv_cache(num_blocks, block_size)

    def run(self, plan: list[tuple[Sequence, int]]) -> list[tuple[Sequence, Draw]]:
        """Compute the planned tokens (advancing each sequence's `computed`) and draw the next token of
        the sequences that are now up to date."""
        device = self.model.device
        spans = [(seq.blocks, seq.computed, seq.computed + n) for seq, n in plan]
        tokens = [t for seq, n in plan for t in seq.tokens[seq.computed:seq.computed + n]]
        step, positions = build_step(spans, self.block_size, device, tokens, self.model.config.vocab_size)
        with torch.no_grad():
            hidden = self.model.forward_cached(step.host.input_ids, positions, step, self.cache)
            rows, ready = [], []
            for i, (seq, n) in enumerate(plan):
                seq.computed += n
                if seq.remaining == 0:
                    rows.append(step.host.cu_seqlens_q[i + 1] - 1)
                    ready.append(seq)
            if not ready:
                return []
            vocab = self.model.config.vocab_size
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
