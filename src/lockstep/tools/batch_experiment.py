"""The batch experiment of "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025), on a
real model: one chat prompt, decoded greedily, alone and inside batches of other chat prompts.

With stock kernels a row's arithmetic depends on what shares its batch (padding, the batch size,
the GEMM the BLAS picks for the shape), so the same prompt at temperature 0 can give several
completions. The experiment counts the unique completions of the prompt under:
- stock transformers `generate` (left padding, as transformers batches);
- transformers `generate` under `lockstep.batch_invariant()`;
- lockstep's Engine over scheduler settings (batch size, token budget and chunked prefill,
  preemption, the prefix cache).
It also measures what RL frameworks correct for: stock transformers' sampled-token logprobs
against a stock training forward over the same tokens. Where stock happens to give one completion
on this CPU, the report says so, and that mismatch is the measured difference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import contract
from ..engine import Engine
from ..numerics.fixed_order import ceil_div
from ..mismatch import mismatch
from ..model import Transformer
from ..sampling import SamplingParams

QUESTIONS = (
    "Tom has 3 apples and buys 4 more. Then he gives 2 to Ann. How many apples does he have now? Explain.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' to Spanish.",
)
# (batch size, position of the prompt under test in the batch)
PLACEMENTS = ((1, 0), (3, 1), (4, 3), (6, 0), (8, 5), (8, 7))
# Engine scheduler settings: (name, max_num_seqs (None: all), max_num_batched_tokens, tight cache, prefix cache)
ENGINE_SETTINGS = (("default", None, 256, False, True), ("max_num_seqs=1", 1, 256, False, True),
                   ("prefill chunks of 16", None, 16, False, True), ("preemption", None, 256, True, True),
                   ("no prefix cache", None, 256, False, False))


@dataclass
class Completions:
    """The completions of the prompt under test, one per run, and how many are unique."""
    path: str
    runs: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def unique(self) -> int:
        return len({tuple(t) for t in self.token_ids})

    def add(self, run: str, ids: list[int], text: str) -> None:
        self.runs.append(run)
        self.token_ids.append(ids)
        self.texts.append(text)

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for text in self.texts:
            counts[text] = counts.get(text, 0) + 1
        return {"path": self.path, "runs": len(self.runs), "unique": self.unique, "completions": counts,
                "seconds": round(self.seconds, 2)}


@dataclass
class ExperimentReport:
    dtype: str
    max_new_tokens: int
    prompt: str
    paths: list[dict] = field(default_factory=list)
    stock_logprob_mismatch: list[dict] = field(default_factory=list)


def has_chat_template(model: Transformer) -> bool:
    from ..model.chat_template import ChatTemplate

    return model.tokenizer is not None and ChatTemplate.for_tokenizer(model.tokenizer) is not None


def chat_prompts(model: Transformer) -> list[list[int]]:
    """QUESTIONS as token ids through the model's own chat template."""
    from ..model.chat_template import ChatTemplate

    template = ChatTemplate.for_tokenizer(model.tokenizer) if model.tokenizer is not None else None
    if template is None:
        raise ValueError("model: the batch experiment needs a model with a chat template (a real checkpoint)")
    return [model.tokenizer.encode(template.render([{"role": "user", "content": q}]), add_bos=False)
            for q in QUESTIONS]


def batch_of(prompts: list[list[int]], size: int, position: int) -> list[list[int]]:
    """A batch of `size` prompts with prompts[0] at `position` and the others around it in order."""
    others = prompts[1:size]
    return others[:position] + [prompts[0]] + others[position:]


def transformers_model(model: Transformer, dtype: torch.dtype):
    """A stock transformers model with `model`'s weights (eager attention), in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = model.config.to_hf()
    config = AutoConfig.for_model(**hf_config)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    state = {name: p.detach().to(dtype) for name, p in model.named_parameters()}
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    return hf


def left_padded(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest] for transformers: each row padded on the left with `pad`."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    return ids, mask


def _until_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids[:ids.index(eos) + 1] if eos is not None and eos in ids else ids


def transformers_greedy(hf, prompts: list[list[int]], max_new_tokens: int, pad: int, eos: int | None,
                        decode, path: str, progress: Callable[[str], None] = lambda text: None) -> Completions:
    """The prompt under test decoded greedily by `hf.generate` at every placement."""
    out = Completions(path)
    started = time.time()
    for i, (size, position) in enumerate(PLACEMENTS):
        progress(f"{path}: batch {size}, position {position} ({i + 1}/{len(PLACEMENTS)})")
        ids, mask = left_padded(batch_of(prompts, size, position), pad)
        with torch.no_grad():
            generated = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                    pad_token_id=pad, eos_token_id=eos)
        completion = _until_eos(generated[position, ids.shape[1]:].tolist(), eos)
        out.add(f"batch {size}, position {position}", completion, decode(completion))
    out.seconds = time.time() - started
    return out


def engine_greedy(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos: int | None,
                  decode, progress: Callable[[str], None] = lambda text: None) -> Completions:
    """The prompt under test decoded greedily by lockstep's Engine at every placement (default
    scheduler), and in the largest batch under every scheduler setting."""
    out = Completions("lockstep Engine")
    started = time.time()
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=[eos] if eos is not None else [])
    # Every placement under the default scheduler, and the other settings in one 8-prompt batch:
    # every run is a whole generate call, and `make verify` must stay short on a 2-core machine.
    runs = [(size, position, ENGINE_SETTINGS[0]) for size, position in PLACEMENTS if size in (1, 4, 8)]
    runs += [(PLACEMENTS[-2][0], PLACEMENTS[-2][1], s) for s in ENGINE_SETTINGS[1:]]
    for i, (size, position, (name, max_num_seqs, budget, tight, prefix)) in enumerate(runs):
        progress(f"lockstep Engine: batch {size}, position {position}, {name} ({i + 1}/{len(runs)})")
        batch = batch_of(prompts, size, position)
        block_size = 16
        num_blocks = 2 * ceil_div(max(map(len, batch)) + max_new_tokens, block_size) + 1 if tight else None
        engine = Engine(model, max_num_seqs=max_num_seqs or len(batch), max_num_batched_tokens=budget,
                        block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix)
        completion = _until_eos(engine.generate(batch, sp)[position].token_ids, eos)
        out.add(f"batch {size}, position {position}, {name}", completion, decode(completion))
    out.seconds = time.time() - started
    return out


def stock_logprob_mismatch(hf, prompts: list[list[int]], max_new_tokens: int, pad: int, eos: int | None,
                           seed: int = 0) -> dict:
    """Stock transformers as an RL framework uses it: sample completions of every prompt in one batch
    (temperature 1), keep the sampler's logprobs of the sampled tokens, and recompute them with a
    training forward over prompt + completion. Returns lockstep.mismatch's metrics
    (contract section 4) over the sampled tokens."""
    ids, mask = left_padded(prompts, pad)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos, output_logits=True,
                          return_dict_in_generate=True)
        sequences = out.sequences
        new = sequences[:, ids.shape[1]:]
        sampler = torch.stack([torch.log_softmax(step.float(), -1) for step in out.logits], 1)   # [B, T, V]
        sampler_lp = sampler.gather(2, new[:, :, None])[:, :, 0]
        full_mask = torch.cat([mask, torch.ones_like(new)], 1)
        logits = hf(input_ids=sequences, attention_mask=full_mask).logits.float()         # the training forward
        train_lp = torch.log_softmax(logits[:, ids.shape[1] - 1:-1], -1).gather(2, new[:, :, None])[:, :, 0]
    keep = torch.ones_like(new, dtype=torch.bool)
    if eos is not None:                 # tokens up to and including each completion's first eos
        after = (new == eos).int().cumsum(1) - (new == eos).int()
        keep = after == 0
    return mismatch(train_lp[keep], sampler_lp[keep])


def run(model_for: Callable[[torch.dtype], Transformer], dtype: torch.dtype, max_new_tokens: int = 48, mismatch_dtypes=(torch.bfloat16, torch.float32),
        log=print, progress: Callable[[str], None] | None = None) -> ExperimentReport:
    """The whole experiment in `dtype`, and the stock logprob mismatch in each of mismatch_dtypes.
    model_for(dtype) returns the lockstep model (a real checkpoint with a chat template); `log` takes
    each result line, `progress` (if given) a line before each generate call."""
    progress = progress or (lambda text: None)
    from ..mode import batch_invariant

    model = model_for(dtype)
    prompts = chat_prompts(model)
    tok = model.tokenizer
    eos = tok.eos_token_id
    pad = eos if eos is not None else 0            # masked out; SmolLM2's own pad token is its eos
    report = ExperimentReport(contract.dtype_name(dtype), max_new_tokens, QUESTIONS[0])
    hf = transformers_model(model, dtype)
    paths = [transformers_greedy(hf, prompts, max_new_tokens, pad, eos, tok.decode, "stock transformers", progress)]
    with batch_invariant():
        paths.append(transformers_greedy(hf, prompts, max_new_tokens, pad, eos, tok.decode,
                                         "transformers + batch_invariant()", progress))
    paths.append(engine_greedy(model, prompts, max_new_tokens, eos, tok.decode, progress))
    for c in paths:
        report.paths.append(c.summary())
        log(f"{report.dtype:9s} {c.path:34s} runs={len(c.runs):<3d} unique completions={c.unique}  ({c.seconds:.0f} s)")
    for mdtype in mismatch_dtypes:
        progress(f"stock transformers in {contract.dtype_name(mdtype)}: sampler vs training logprobs")
        stock = hf if mdtype == dtype else transformers_model(model, mdtype)
        row = {"dtype": contract.dtype_name(mdtype), **stock_logprob_mismatch(stock, prompts, max_new_tokens, pad, eos)}
        report.stock_logprob_mismatch.append(row)
        log(f"{row['dtype']:9s} stock transformers: sampler logprobs vs a training forward over {row['tokens']} tokens: "
            f"max_abs_dlogp={row['max_abs_dlogp']:.3g} approx_kl0={row['approx_kl0']:.3g} "
            f"clipfrac0={row['clipfrac0']:.3g}")
    return report


def summary_lines(report: ExperimentReport) -> list[str]:
    """What a person reads: the prompt, each path's completions, and what the numbers mean."""
    lines = [f"prompt: {report.prompt!r}"]
    for p in report.paths:
        lines.append(f"{p['path']}: {p['unique']} unique completion(s) in {p['runs']} runs")
        for text, count in p["completions"].items():
            lines.append(f"  {count} x {text!r}")
    stock = report.paths[0]
    if stock["unique"] == 1:
        lines.append("stock transformers gave one completion at every placement on this machine; the measured "
                     "difference is the logprob mismatch above, which lockstep's engine and trainer do not have")
    return lines

