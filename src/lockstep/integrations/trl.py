"""TRL's GRPOTrainer with zero train-inference mismatch.

Two routes, each one line after the trainer is built:

    trainer = GRPOTrainer(model, reward_funcs, args=config, train_dataset=data, processing_class=tokenizer)
    lockstep.integrations.trl.exact(trainer)               # sampling stays transformers' generate

    trainer = GRPOTrainer(..., rollout_func=lockstep.integrations.trl.rollout_func())
                                                           # sampling through lockstep's Engine

`exact(trainer)` patches the model onto lockstep's ops, gives its training forward the position ids
`generate` uses, runs `generate` under the trainer's autocast (so bf16=True samples at the precision
it trains in), and replaces TRL's fused LM head with lockstep's `selected_logprobs`. The
sampling-time logprob of every generated token is then computed by the same op from the same bits
as the training forward's: the two are equal bit for bit.

`rollout_func()` samples with lockstep's Engine over a lockstep Transformer whose parameters *are*
the trainer model's (no weight copy: an optimizer step is seen by the next rollout), and the training
forward is lockstep's trainer's own `packed_logprobs` (with the entropy TRL logs) over that same
Transformer and the unpadded sequences. The Engine's logprobs go to TRL as the sampling logprobs, and
equal the trainer's bit for bit.

Both (and `measure(trainer)`, which changes nothing and only measures) log, per step, into TRL's
metrics: `lockstep/max_abs_dlogp` (max |training - sampling logprob| over the step's tokens),
`lockstep/approx_kl0` (mean of e^d - 1 - d, an estimate of KL(sampler || trainer)), `lockstep/clipfrac0`, `lockstep/mean_ratio`
(mean e^d, the importance ratio) and `lockstep/tokens` (lockstep.mismatch).
"""

from __future__ import annotations

import dataclasses
import types
from contextlib import nullcontext
from typing import Callable

import torch
from torch import Tensor

from .. import ops
from ..mismatch import FIELDS, mismatch
from ..model import packed_logprobs, token_entropy

METRICS = tuple(f"lockstep/{name}" for name in FIELDS)


class _Comparison:
    """Sampling logprobs by sequence, and their comparison with what the training forward computes."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.sampled: dict[tuple[int, ...], list[float]] = {}

    def record(self, prompt: list[int], completion: list[int], logprobs: list[float]) -> None:
        self.sampled[tuple(prompt) + tuple(completion)] = [float(x) for x in logprobs]

    def compare(self, input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor, log_probs: Tensor) -> None:
        """Rows of a fused-head forward: log_probs [B, T - 1] of labels[:, 1:]."""
        trained_parts, sampled_parts = [], []
        mask = labels[:, 1:] != -100
        for b in range(input_ids.shape[0]):
            keep = attention_mask[b].bool() if attention_mask is not None else torch.ones_like(input_ids[b], dtype=torch.bool)
            seq = tuple(input_ids[b][keep].tolist())
            sampled = self.sampled.get(seq)
            if sampled is None:
                continue
            trained = log_probs[b][mask[b]].detach().double().cpu()
            if trained.numel() != len(sampled):
                continue
            trained_parts.append(trained)
            sampled_parts.append(torch.tensor(sampled, dtype=torch.float64))
        if not trained_parts:
            return
        mode = "train" if self.trainer.model.training else "eval"
        metrics = self.trainer._metrics[mode]
        for name, value in mismatch(torch.cat(trained_parts), torch.cat(sampled_parts)).items():
            metrics[f"lockstep/{name}"].append(float(value))


def _fused_output(log_probs: Tensor, entropy: Tensor, mask: Tensor, num_items_in_batch):
    from trl.trainer.utils import FusedCausalLMOutput

    loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)


def _head(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
          softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-row log p(target) (differentiable) and entropy (for logging) at `temperature`, by lockstep;
    softcap: the model's final-logit softcapping."""
    log_probs = ops.selected_logprobs(hidden, weight, targets, temperature=temperature, softcap=softcap)
    with torch.no_grad():
        entropy = token_entropy(ops.vocab_logprobs(hidden, weight, temperature=temperature, softcap=softcap))
    return log_probs, entropy


def _on_grid(values: Tensor, attention_mask: Tensor, mask: Tensor) -> Tensor:
    """Values of packed_logprobs' rows (float [sum(len_b - 1)], sequence by sequence) on TRL's grid of
    labels[:, 1:] ([B, T - 1]): row b's len_b - 1 values stand at its columns whose token has a next
    one, and 0 where mask ([B, T - 1] bool) is False. attention_mask: [B, T], each row's tokens in one
    run (padding on the left, the right or both)."""
    kept = attention_mask.bool()
    grid = kept[:, :-1] & kept[:, 1:]
    if int(grid.sum()) != values.numel():
        raise ValueError(f"attention_mask: expected each row's tokens in one run, {values.numel()} of them with a "
                         f"next token in all; got {int(grid.sum())}")
    return torch.where(mask, values.new_zeros(grid.shape).masked_scatter(grid, values), 0.0)


def _wrap_training_forward(model, comparison: _Comparison, head: Callable | None) -> None:
    """model.forward(..., fused_lm_head=True) computes its per-token logprobs with `head` (None: TRL's
    own), and every call compares them with the sampled ones."""
    previous = model.forward

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:            # generate and plain forwards go to TRL's forward, unchanged
            return previous(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                            **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if head is None:
            out = previous(*args, fused_lm_head=True, labels=labels, shift_labels=shift_labels,
                           num_items_in_batch=num_items_in_batch, **kwargs)
        else:
            out = head(self, input_ids, kwargs.get("attention_mask"), labels, num_items_in_batch)
        comparison.compare(input_ids, kwargs.get("attention_mask"), labels, out.log_probs)
        return out

    model.forward = types.MethodType(forward, model)


def _completions(sequences: Tensor, prompt_width: int, attention_mask: Tensor, eos: set[int]):
    """(prompt ids, completion ids up to and including the first EOS, its row) for each generated row."""
    for b in range(sequences.shape[0]):
        prompt = sequences[b, :prompt_width][attention_mask[b].bool()].tolist()
        completion = []
        for t in sequences[b, prompt_width:].tolist():
            completion.append(t)
            if t in eos:
                break
        yield prompt, completion, b


def _eos_ids(trainer) -> set[int]:
    ids = getattr(trainer, "eos_token_ids", None)
    if ids is None:
        eos = trainer.processing_class.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
    return {int(i) for i in ids if i is not None}


def _wrap_generate(model, trainer, comparison: _Comparison, logprob_of: Callable[[Tensor, Tensor], Tensor],
                   autocast: bool) -> None:
    """model.generate records each generated token's sampling-time logprob: logprob_of(hidden, token)
    of the hidden state the LM head saw when the token was drawn."""
    previous = model.generate
    head_module = model.get_output_embeddings()

    def generate(*args, **kwargs):
        seen: list[Tensor] = []
        hook = head_module.register_forward_pre_hook(lambda m, inputs: seen.append(inputs[0][:, -1].detach()))
        try:
            with trainer.accelerator.autocast() if autocast else nullcontext():
                sequences = previous(*args, **kwargs)
        finally:
            hook.remove()
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        with torch.no_grad(), trainer.accelerator.autocast() if autocast else nullcontext():
            for prompt, completion, b in _completions(sequences, ids.shape[1], mask, _eos_ids(trainer)):
                steps = torch.stack([seen[i][b] for i in range(len(completion))])
                comparison.record(prompt, completion, logprob_of(steps, torch.tensor(completion)).tolist())
        return sequences

    model.generate = generate


def measure(trainer) -> _Comparison:
    """Change nothing; log how far TRL's sampling-time logprobs (log softmax of generate's logits at
    the trainer's temperature) are from its training forward's."""
    model = trainer.model
    comparison = _Comparison(trainer)
    lm_head, temperature = model.get_output_embeddings(), trainer.temperature

    def stock(hidden, tokens):
        logits = lm_head(hidden).float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]

    _wrap_generate(model, trainer, comparison, stock, autocast=False)
    _wrap_training_forward(model, comparison, head=None)
    return comparison


def exact(trainer) -> _Comparison:
    """Zero mismatch with transformers' generate as the sampler (module docstring)."""
    from .hf import patch

    model = trainer.model
    patch(model, positions_from_mask=True)
    comparison = _Comparison(trainer)
    temperature = trainer.temperature
    weight = lambda: model.get_output_embeddings().weight  # noqa: E731  (looked up per call: it trains)
    cap = getattr(model.config, "final_logit_softcapping", None)

    def training_head(self, input_ids, attention_mask, labels, num_items_in_batch):
        backbone = getattr(self, "model", None) or self.base_model
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        mask = targets != -100
        lp, ent = _head(hidden[mask], weight(), targets[mask], temperature, cap)
        return _fused_output(hidden.new_zeros(mask.shape, dtype=lp.dtype).masked_scatter(mask, lp),
                             hidden.new_zeros(mask.shape, dtype=ent.dtype).masked_scatter(mask, ent), mask,
                             num_items_in_batch)

    _wrap_generate(model, trainer, comparison,
                   lambda h, t: ops.selected_logprobs(h, weight(), t, temperature, softcap=cap),
                   autocast=True)
    _wrap_training_forward(model, comparison, head=training_head)
    return comparison


def shared_transformer(hf_model):
    """A lockstep Transformer whose parameters are `hf_model`'s own Parameter objects (the names are
    the same), so that it trains and samples with the trainer's weights without a copy."""
    from ..model import ModelConfig, Transformer

    config = ModelConfig.from_hf(hf_model.config.to_dict())
    model = Transformer(config)
    own = dict(hf_model.named_parameters())
    for name, _ in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, own[name])
    return model


def rollout_func(max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, block_size: int = 16):
    """A GRPOTrainer rollout_func that samples through lockstep's Engine (module docstring)."""
    state: dict = {}

    def setup(trainer) -> None:
        from ..engine import Engine

        hf_model = trainer.model
        model = shared_transformer(hf_model)
        comparison = _Comparison(trainer)
        temperature = trainer.temperature

        def training_head(self, input_ids, attention_mask, labels, num_items_in_batch):
            kept = attention_mask.bool()
            lp, _, ent = packed_logprobs(model, [input_ids[b][kept[b]] for b in range(input_ids.shape[0])],
                                         temperature, entropy=True)
            mask = labels[:, 1:] != -100
            return _fused_output(_on_grid(lp, attention_mask, mask), _on_grid(ent, attention_mask, mask), mask,
                                 num_items_in_batch)

        _wrap_training_forward(hf_model, comparison, head=training_head)
        state.update(model=model, comparison=comparison,
                     engine=lambda: Engine(model, max_num_seqs=max_num_seqs,
                                           max_num_batched_tokens=max_num_batched_tokens, block_size=block_size))

    def rollout(prompts: list, trainer) -> dict:
        from ..sampling import SamplingParams

        if not state:
            setup(trainer)
        tok = trainer.processing_class
        # TRL hands every completion's prompt (each prompt num_generations times in a row): one request
        # per run of equal prompts, with n completions (noise streams 0..n-1).
        groups: list[list] = []
        for p in prompts:
            if groups and groups[-1][0] == p:
                groups[-1][1] += 1
            else:
                groups.append([p, 1])
        prompt_ids = []
        for p, _ in groups:
            if isinstance(p, list):            # conversational: the chat template, at the backend boundary
                ids = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
                # transformers 5 answers with a BatchEncoding (return_dict defaults to True), 4 with a list.
                prompt_ids.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
            else:
                prompt_ids.append(tok(p, add_special_tokens=False)["input_ids"])
        args = trainer.args
        base = SamplingParams(temperature=trainer.temperature, top_p=args.top_p if args.top_p is not None else 1.0,
                              top_k=args.top_k or 0, min_p=args.min_p or 0.0,
                              repetition_penalty=args.repetition_penalty or 1.0,
                              max_new_tokens=trainer.max_completion_length, stop_token_ids=sorted(_eos_ids(trainer)),
                              seed=int(trainer.state.global_step) * 1_000_003 + args.seed)
        params = [dataclasses.replace(base, n=count) for _, count in groups]
        with torch.no_grad(), trainer.accelerator.autocast():
            outs = state["engine"]().generate(prompt_ids, params)
        errors = [o.error for o in outs if o.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"lockstep rollout: {errors[0]}")
        result = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        owners = [g for g, (_, count) in enumerate(groups) for _ in range(count)]
        for g, o in zip(owners, outs):
            result["prompt_ids"].append(prompt_ids[g])
            result["completion_ids"].append(o.token_ids)
            result["logprobs"].append(o.logprobs)
            state["comparison"].record(prompt_ids[g], o.token_ids, o.logprobs)
        return result

    return rollout
