"""lockstep.train.losses: what the Trainer minimises, as a function of the trained tokens' logprobs.

Every loss here is a sum over the window's trained tokens of a per-token term l(logprob) of that
token alone, weighted per sequence:

    loss = sum_i scale_i * sum_{t trained in sequence i} l_t  /  normalizer

token mean: scale_i = 1 and normalizer = the window's trained tokens; sequence mean: scale_i =
1 / (sequence i's trained tokens) and normalizer = the trained sequences. The normalizer is the
whole window's, never a micro-batch's: per-micro-batch normalization would weight a token of a
short micro-batch more than one of a long micro-batch. A loss gives l and dl/dlogprob elementwise,
from lockstep's own exp, so each token's gradient depends on that token alone and the Trainer can
keep every sequence's gradient apart (docs/adr/0007).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..numerics.fixed_order import exp
from ..model import ModelConfig, Transformer, packed_logprobs

MEANS = ("token", "sequence")


class TokenLoss:
    """The per-token form that the Trainer takes (see the module docstring). Subclasses give `terms`."""

    mean: str = "token"
    temperature: float = 1.0          # the logprobs are those of logits / temperature (the sampler's)

    def terms(self, logprobs: Tensor, first: int, last: int) -> tuple[Tensor, Tensor]:
        """(l, dl/dlogprob), float32 [tokens], for the targets of the window's sequences [first, last)
        given their logprobs (float32 [tokens], detached)."""
        raise NotImplementedError

    def weights(self, masks: list[Tensor]) -> tuple[list[float], float]:
        """(scale_i for each sequence, normalizer) of a window whose sequence i trains masks[i]."""
        counts = [int(m.sum()) for m in masks]
        if self.mean == "token":
            return [1.0] * len(masks), float(sum(counts))
        return [1.0 / c if c else 0.0 for c in counts], float(sum(1 for c in counts if c))


class CrossEntropy(TokenLoss):
    """Supervised training: l = -log p(target)."""

    def terms(self, logprobs: Tensor, first: int, last: int) -> tuple[Tensor, Tensor]:
        return -logprobs, torch.full_like(logprobs, -1.0)


@dataclass
class PolicyLoss(TokenLoss):
    """PPO-clip / GRPO: l = -min(r A, clip(r, 1 - clip, 1 + clip) A) + kl_coef * k3, with the
    importance ratio r = exp(logprob - sampler logprob) and k3 = exp(ref - logprob) - (ref -
    logprob) - 1, the KL estimate to a frozen reference model (Schulman's k3, as GRPO uses it).

    Per sequence i of the window: sampler_logprobs[i] and ref_logprobs[i] ([len_i - 1] float32,
    aligned with the targets; untrained positions are ignored) and advantages[i] (a number). When the
    sampler's logprobs are the trainer's bits, r is exactly 1 and the update is exactly on-policy.
    `trainer_logprobs` keeps, per sequence, the logprobs this loss saw (before the update): what to
    compare with the sampler's."""

    sampler_logprobs: list[Tensor]
    advantages: list[float]
    ref_logprobs: list[Tensor] | None = None
    clip: float = 0.2
    kl_coef: float = 0.0
    mean: str = "token"
    temperature: float = 1.0
    trainer_logprobs: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        n = len(self.sampler_logprobs)
        if len(self.advantages) != n:
            raise ValueError(f"advantages: expected one per sequence ({n}), got {len(self.advantages)}")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs: expected one per sequence ({n}), got {len(self.ref_logprobs)}")
        if self.kl_coef and self.ref_logprobs is None:
            raise ValueError(f"ref_logprobs: kl_coef {self.kl_coef} needs the reference model's logprobs")
        if not (isinstance(self.clip, (int, float)) and 0 < self.clip < 1):
            raise ValueError(f"clip: expected a number in (0, 1), got {self.clip!r}")
        if not (isinstance(self.kl_coef, (int, float)) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef: expected a number >= 0, got {self.kl_coef!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature: expected a positive number (the sampler's), got {self.temperature!r}")
        if self.mean not in MEANS:
            raise ValueError(f"mean: expected one of {MEANS}, got {self.mean!r}")

    def terms(self, logprobs: Tensor, first: int, last: int) -> tuple[Tensor, Tensor]:
        sizes = [t.numel() for t in self.sampler_logprobs[first:last]]
        if sum(sizes) != logprobs.numel():
            raise ValueError(f"sampler_logprobs: sequences {first}..{last - 1} have {sum(sizes)} targets, the "
                             f"window's sequences {logprobs.numel()}")
        for i, part in zip(range(first, last), torch.split(logprobs, sizes)):
            self.trainer_logprobs[i] = part.detach().clone()
        old = torch.cat(self.sampler_logprobs[first:last]).to(logprobs.device, torch.float32)
        adv = torch.cat([torch.full((n,), float(a), dtype=torch.float32)
                         for n, a in zip(sizes, self.advantages[first:last])]).to(logprobs.device)
        ratio = exp(logprobs - old)
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        unclipped_term, clipped_term = ratio * adv, clipped * adv
        value = -torch.minimum(unclipped_term, clipped_term)
        # Where the unclipped term is the smaller (or they tie, inside the clip range), d/dlp of
        # -r A is -r A; where the clipped term wins, the objective is flat.
        grad = torch.where(unclipped_term <= clipped_term, -unclipped_term, torch.zeros_like(ratio))
        if self.kl_coef:
            ref = torch.cat(self.ref_logprobs[first:last]).to(logprobs.device, torch.float32)
            d = ref - logprobs
            back = exp(d)
            value = value + self.kl_coef * (back - d - 1)
            grad = grad + self.kl_coef * (1 - back)
        return value, grad


def cross_entropy_sum(model: Transformer, sequences: list[Tensor], loss_mask: list[Tensor] | None = None) -> tuple[Tensor, int]:
    """Sum of -log p over the trained tokens of packed sequences, and their count.

    loss_mask[i] ([len_i - 1] bool) marks the targets of sequence i that count (the rest are
    ignored, like ignore_index). Padding sequences are all-False."""
    lp, _ = packed_logprobs(model, sequences)
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
        from ..model.moe import load_balancing_loss

        out, start = [], 0
        for n, counts in zip(lengths, trained):
            rows = [r[start:start + n] for r in router_logits]
            out.append(load_balancing_loss(rows, self.config.num_experts, self.config.num_experts_per_tok)
                       if counts else torch.zeros((), dtype=torch.float32))
            start += n
        return out


