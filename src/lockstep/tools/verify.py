"""`lockstep verify`: the train-inference gate (docs/contract.md, section 4).

For each dtype it generates completions under a sweep of engine settings. The sweep covers
max_num_seqs 1, 3 and all; token budgets that cut prefill into chunks; arrival orders; a cache small
enough to force preemption; and greedy and seeded temperature sampling. It then recomputes every
completion's logprobs with the trainer path (`lockstep.logprobs`), alone and batched, and reports
max_abs_dlogp, approx_kl0, clipfrac0 and token agreement. It reports the same numbers for plain
PyTorch (the same engine and trainer on the "eager" backend), so the mismatch lockstep removes is
visible next to its absence. It also checks that the gradient of a sequence's loss with respect to
its input embeddings is bitwise the same alone and in a batch.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .. import contract
from ..engine import Engine, RequestOutput
from ..numerics.fixed_order import ceil_div
from ..mismatch import mismatch
from ..model import Transformer, logprobs, pack
from ..registry import use_backend
from ..sampling import SamplingParams


@dataclass(frozen=True)
class Setting:
    name: str
    max_num_seqs: int | None = None        # None: all prompts at once
    budget: int = 64                       # max_num_batched_tokens
    order: str = "given"                   # given, reversed, shuffled
    tight_cache: bool = False              # a cache that holds ~2 requests: forces preemption
    prefix_caching: bool = True
    n: int = 1                             # completions per prompt (they share the prompt's blocks)


SETTINGS = (
    Setting("max_num_seqs=all, budget 64"),
    Setting("max_num_seqs=1", max_num_seqs=1),
    Setting("max_num_seqs=3", max_num_seqs=3),
    Setting("prefill chunks of 7", budget=7),
    Setting("prefill chunks of 16, 3 seqs", max_num_seqs=3, budget=16),
    Setting("reversed arrival", order="reversed"),
    Setting("shuffled arrival", order="shuffled"),
    Setting("tight cache (preemption)", tight_cache=True),
    Setting("no prefix caching", prefix_caching=False),
    Setting("4 completions per prompt", n=4),
)


@dataclass
class Aggregates:
    """One row of the gate, over every engine setting: the engine's logprobs against the trainer's
    recomputation of the same tokens (lockstep.mismatch). Exact means no difference at all."""
    max_abs_dlogp: float = 0.0      # max |trainer - engine| logprob over every token
    approx_kl0: float = 0.0         # k3 estimate of KL(engine || trainer), before any update
    clipfrac0: float = 0.0          # share of tokens whose ratio falls outside the contract's clip range
    tokens: int = 0                 # tokens compared
    token_agreement: float = 1.0    # share of first completions that equal the first setting's
    settings: int = 0               # engine settings run (SETTINGS)

    @property
    def exact(self) -> bool:
        return self.tokens > 0 and self.max_abs_dlogp == 0 and self.approx_kl0 == 0 and self.clipfrac0 == 0 \
            and self.token_agreement == 1.0


def _generate(model: Transformer, prompts: list[list[int]], sp: SamplingParams, s: Setting,
              max_new_tokens: int) -> tuple[list[RequestOutput], list[int]]:
    """The completions of one setting, and the prompt of each: first every prompt's first completion in
    prompt order, then the others."""
    order = list(range(len(prompts)))
    if s.order == "reversed":
        order.reverse()
    elif s.order == "shuffled":
        random.Random(1234).shuffle(order)
    block_size = 8
    num_blocks = None
    if s.tight_cache:
        longest = max(len(p) for p in prompts) + max_new_tokens
        num_blocks = 2 * ceil_div(longest, block_size) + 1
    engine = Engine(model, max_num_seqs=s.max_num_seqs or s.n * len(prompts), max_num_batched_tokens=s.budget,
                    block_size=block_size, num_blocks=num_blocks, prefix_caching=s.prefix_caching)
    outs = engine.generate([prompts[i] for i in order], dataclasses.replace(sp, n=s.n))
    # The first completion of each prompt draws from the same noise as a request with n = 1: it is the
    # one compared across settings; all n are compared with the trainer.
    by_prompt: list[RequestOutput | None] = [None] * len(prompts)
    extra: list[tuple[int, RequestOutput]] = []
    for j, o in enumerate(outs):
        i = order[j // s.n]
        if o.index == 0:
            by_prompt[i] = o
        else:
            extra.append((i, o))
    errors = [o.error for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"engine refused a request in setting {s.name!r}: {errors[0]}")
    return by_prompt + [o for _, o in extra], [i for i in range(len(prompts))] + [i for i, _ in extra]


def _compare(model: Transformer, prompts: list[list[int]], runs: list[tuple[list[RequestOutput], list[int]]],
             temperature: float, clip: tuple[float, float], alone_too: bool) -> Aggregates:
    """runs: (completions, the prompt of each) per setting; the first len(prompts) completions of a run
    are the prompts' first ones, compared across settings."""
    trained, sampled, agree, total = [], [], 0, 0
    base = runs[0][0][:len(prompts)]
    for outs, owners in runs:
        seqs = [prompts[i] + o.token_ids for i, o in zip(owners, outs)]
        with torch.no_grad():
            batched = logprobs(model, seqs, temperature=temperature)
            views = [batched]
            if alone_too:
                views.append([logprobs(model, [s], temperature=temperature)[0] for s in seqs])
        for view in views:
            for lp, o in zip(view, outs):
                n = len(o.token_ids)
                trained.append(lp[-n:])
                sampled.append(torch.tensor(o.logprobs, dtype=torch.float32))
        for o, b in zip(outs[:len(prompts)], base):
            total += 1
            agree += o.token_ids == b.token_ids
    m = mismatch(torch.cat(trained), torch.cat(sampled), clip)
    return Aggregates(m["max_abs_dlogp"], m["approx_kl0"], m["clipfrac0"], m["tokens"], agree / total, len(runs))


def embedding_grad(model: Transformer, batch: list[list[int]], which: int) -> torch.Tensor:
    """d(sum of logprobs of sequence `which`) / d(its input embeddings), computed inside `batch`."""
    ids, cu = pack(batch, model.device)
    emb = model.embed(ids).detach().requires_grad_()
    hidden = model(None, cu, inputs_embeds=emb)
    a, b = int(cu[which]), int(cu[which + 1])
    model.selected_logprobs(hidden[a:b - 1], ids[a + 1:b]).sum().backward()
    return emb.grad[a:b]


def backward_chain_ok(model: Transformer, prompts: list[list[int]]) -> bool:
    """A sequence's input-embedding gradient alone equals the same in a batch, bitwise."""
    seqs = [p for p in prompts if len(p) > 1][:4]
    ok = True
    for i in range(len(seqs)):
        alone = embedding_grad(model, [seqs[i]], 0)
        ok &= torch.equal(embedding_grad(model, seqs, i), alone)
        ok &= torch.equal(embedding_grad(model, seqs[::-1], len(seqs) - 1 - i), alone)
    return bool(ok)


@dataclass
class VerifyReport:
    rows: list[dict] = field(default_factory=list)
    backward_chain: dict[str, bool] = field(default_factory=dict)
    passed: bool = True


def default_prompts(vocab: int, seed: int = 0, lengths=(3, 17, 1, 40, 9, 64, 25, 6)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def samplings(max_new_tokens: int, seed: int) -> list[tuple[str, SamplingParams]]:
    return [("greedy", SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)),
            ("T=0.8 top-k 40 top-p 0.95", SamplingParams(temperature=0.8, top_k=40, top_p=0.95,
                                                         max_new_tokens=max_new_tokens, seed=seed))]


def run(make_model: Callable[[torch.dtype], Transformer], dtypes: list[torch.dtype], prompts: list[list[int]] | None = None,
        max_new_tokens: int = 16, seed: int = 0, settings: tuple[Setting, ...] | None = None,
        with_eager: bool = True, log: Callable[[str], None] = print,
        progress: Callable[[str], None] | None = None) -> VerifyReport:
    """The gate for each of `dtypes`: every engine setting against the trainer's logprobs, for each
    sampling, and the eager rows beside them; `log` takes each result line, `progress` (if given) a
    line before each step."""
    settings = settings or SETTINGS
    progress = progress or (lambda text: None)
    clip = tuple(contract.load()["chain"]["clip_range"])
    report = VerifyReport()
    for dtype in dtypes:
        model = make_model(dtype)
        ps = prompts or default_prompts(model.config.vocab_size, seed)
        for label, sp in samplings(max_new_tokens, seed):
            temp = sp.temperature if sp.temperature > 0 else 1.0
            started = time.time()
            runs = []
            for i, s in enumerate(settings):
                progress(f"{contract.dtype_name(dtype)} {label}: engine setting {i + 1}/{len(settings)}, {s.name}")
                runs.append(_generate(model, ps, sp, s, max_new_tokens))
            progress(f"{contract.dtype_name(dtype)} {label}: the trainer's logprobs of every completion")
            agg = _compare(model, ps, runs, temp, clip, alone_too=True)
            row = {"dtype": contract.dtype_name(dtype), "sampling": label, "path": "lockstep", **asdict(agg),
                   "exact": agg.exact, "seconds": round(time.time() - started, 2)}
            report.rows.append(row)
            report.passed &= agg.exact
            log(_format_row(row))
            if with_eager:
                progress(f"{contract.dtype_name(dtype)} {label}: eager PyTorch")
                with use_backend("eager"):
                    eager_settings = (settings[0], settings[1])
                    eruns = [_generate(model, ps, sp, s, max_new_tokens) for s in eager_settings]
                    eagg = _compare(model, ps, eruns, temp, clip, alone_too=False)
                row = {"dtype": contract.dtype_name(dtype), "sampling": label, "path": "eager PyTorch",
                       **asdict(eagg), "exact": eagg.exact}
                report.rows.append(row)
                log(_format_row(row))
        progress(f"{contract.dtype_name(dtype)}: the backward chain")
        ok = backward_chain_ok(model, ps)
        report.backward_chain[contract.dtype_name(dtype)] = ok
        report.passed &= ok
        log(f"{contract.dtype_name(dtype):9s} backward chain (input-embedding grads alone vs batched): "
            f"{'identical' if ok else 'DIFFERENT'}")
    return report


def _format_row(r: dict) -> str:
    def f(x: float) -> str:
        return "0" if x == 0 else (f"{x:.2e}" if math.isfinite(x) else "inf")
    return (f"{r['dtype']:9s} {r['sampling']:26s} {r['path']:14s} settings={r['settings']:<2d} "
            f"tokens={r['tokens']:<5d} agreement={100 * r['token_agreement']:6.2f}%  max_abs_dlogp={f(r['max_abs_dlogp']):9s} "
            f"approx_kl0={f(r['approx_kl0']):9s} clipfrac0={f(r['clipfrac0'])}")
