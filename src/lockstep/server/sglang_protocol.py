"""SGLang's native request bodies and answers (its io_struct's GenerateReqInput and
UpdateWeightFromDiskReqInput, and its /generate output), as lockstep serves them.

POST /generate takes `text` or `input_ids`, one prompt or a batch, with `sampling_params` (one for
all, or one per prompt), `return_logprob`, `logprob_start_len`, `top_logprobs_num`,
`return_text_in_logprobs`, `stream` and `rid`. It answers one object for one prompt with n = 1 and
a list otherwise (prompt by prompt, n completions each):

    {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version",
     "completion_tokens", "cached_tokens", "e2e_latency", "output_token_logprobs", ...}}

Logprobs are SGLang's [logprob, token_id, text or None] triples (text with
return_text_in_logprobs): `output_token_logprobs`, `output_top_logprobs` (top_logprobs_num > 0),
and, when logprob_start_len >= 0, `input_token_logprobs` (and `input_top_logprobs`) from that prompt
position on, the first token's logprob None. They are at the request's temperature (1 when
greedy), as lockstep.logprobs recomputes them. finish_reason is SGLang's object: {"type": "stop",
"matched": token id or string}, {"type": "length", "length": max_new_tokens} or {"type": "abort",
"message": why}, and None in a stream's chunks before the last.

As everywhere in lockstep, unknown fields are refused rather than ignored. SGLang's other fields,
which its router sends on every request, are accepted at the values that change nothing
(compat.GENERATE, compat.GENERATE_SAMPLING) and refused, naming what is accepted, at any other;
`model` is accepted and, as on /v1, not checked: the server serves one model.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..engine import RequestOutput
from ..sampling import SamplingParams
from . import compat
from .state import RequestError, describe_validation_error, refuse_unsupported

# SGLang's default max_new_tokens; lockstep cuts it to what the context leaves.
DEFAULT_MAX_NEW_TOKENS = 128
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "n", "stop",
                    "stop_token_ids")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Sampling(_Strict):
    """`sampling_params` of POST /generate (SGLang's names; top_k -1 or 0: no top-k)."""

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_new_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=SamplingParams.MAX_N)
    stop: Any = Field(None, validate_default=True)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v if v is not None else []
        if not isinstance(stops, list) or len(stops) > 16 or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("expected a string or up to 16 non-empty strings")
        return stops


GenerateSampling = compat.with_fields("GenerateSampling", _Sampling, compat.GENERATE_SAMPLING)


class _Generate(_Strict):
    """POST /generate. The polymorphic fields (one value or one per prompt) are checked by `items`."""

    model: str | None = None
    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    return_logprob: Any = False
    logprob_start_len: Any = -1
    top_logprobs_num: Any = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Any = None


GenerateRequest = compat.with_fields("GenerateRequest", _Generate, compat.GENERATE)


class _UpdateWeightsFromDisk(_Strict):
    """POST /update_weights_from_disk; SGLang's other fields at the values of compat.UPDATE_FROM_DISK."""

    model_path: str
    abort_all_requests: bool = False
    weight_version: str | None = None


UpdateWeightsFromDiskRequest = compat.with_fields("UpdateWeightsFromDiskRequest", _UpdateWeightsFromDisk,
                                                  compat.UPDATE_FROM_DISK)


@dataclass
class Item:
    """One prompt of a /generate request, ready for the engine."""

    prompt: list[int]
    params: SamplingParams
    ids: list[str]                    # meta_info.id of each of its n completions
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompts(body: GenerateRequest) -> tuple[list, str, bool]:
    """(the prompts, the field they came in, whether it was one prompt rather than a batch)."""
    if body.text is not None and body.input_ids is not None:
        raise RequestError(400, "text: send either text or input_ids, not both", "text")
    if body.text is not None:
        if isinstance(body.text, str):
            return [body.text], "text", True
        if isinstance(body.text, list) and body.text and all(isinstance(t, str) for t in body.text):
            return list(body.text), "text", False
        raise RequestError(400, "text: expected a string or a non-empty list of strings", "text")
    ids = body.input_ids
    if ids is None:
        raise RequestError(400, "text: expected text or input_ids", "text")
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        return list(ids), "input_ids", False
    if isinstance(ids, list) and all(_int(t) for t in ids):
        return [ids], "input_ids", True
    raise RequestError(400, "input_ids: expected token ids or a non-empty list of lists of token ids", "input_ids")


def _per_prompt(value, field: str, count: int, check: Callable[[Any], bool], expected: str) -> list:
    """One value per prompt: `value` itself for every prompt, or a list of one per prompt."""
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count:
        raise RequestError(400, f"{field}: expected one value or one per prompt ({count}), got {len(values)}", field)
    for v in values:
        if not check(v):
            raise RequestError(400, f"{field}: expected {expected}, got {v!r}", field)
    return values


def _sampling_specs(raw, count: int) -> list[tuple[GenerateSampling, str]]:
    """Each prompt's GenerateSampling and the path of the object it came from."""
    raws = raw if isinstance(raw, list) else [raw] * count
    if isinstance(raw, list) and len(raw) != count:
        raise RequestError(400, f"sampling_params: expected one object or one per prompt ({count}), got {len(raw)}",
                           "sampling_params")
    specs = []
    for k, r in enumerate(raws):
        where = f"sampling_params.{k}" if isinstance(raw, list) else "sampling_params"
        try:
            spec = GenerateSampling.model_validate({} if r is None else r)
        except ValidationError as e:
            param, message = describe_validation_error(e.errors()[0], where)
            raise RequestError(400, message, param) from None
        refuse_unsupported(spec, compat.GENERATE_SAMPLING, where)
        specs.append((spec, where))
    return specs


def items(body: GenerateRequest, server) -> tuple[list[Item], bool]:
    """The prompts of a /generate request, each checked (the engine's own check, lockstep.engine.requests)
    and ready to run; and whether the answer is one object rather than a list."""
    refuse_unsupported(body, compat.GENERATE)
    prompts, field, single = _prompts(body)
    count = len(prompts)
    encoded = [server.encode(p, field) for p in prompts]
    specs = _sampling_specs(body.sampling_params, count)
    want = _per_prompt(body.return_logprob, "return_logprob", count, lambda v: isinstance(v, bool), "true or false")
    starts = _per_prompt(body.logprob_start_len, "logprob_start_len", count, lambda v: _int(v) and v >= -1,
                         "an int >= -1")
    tops = _per_prompt(body.top_logprobs_num, "top_logprobs_num", count, lambda v: _int(v) and v >= 0, "an int >= 0")
    total = sum(spec.n for spec, _ in specs)
    single = single and total == 1
    rids = _rids(body.rid, count, [spec.n for spec, _ in specs], single)
    out = []
    for k, (prompt, (spec, where), ret, start, top) in enumerate(zip(encoded, specs, want, starts, tops)):
        if ret and start >= len(prompt):
            raise RequestError(400, f"logprob_start_len: {start} is not below the prompt's {len(prompt)} tokens",
                               "logprob_start_len")
        max_new = spec.max_new_tokens if spec.max_new_tokens is not None else min(DEFAULT_MAX_NEW_TOKENS,
                                                                                  server.room([prompt]))
        params = SamplingParams(
            temperature=spec.temperature, top_k=max(0, spec.top_k), top_p=spec.top_p, min_p=spec.min_p,
            repetition_penalty=spec.repetition_penalty,
            max_new_tokens=max_new,
            n=spec.n, stop=list(spec.stop), stop_token_ids=list(spec.stop_token_ids or []),
            logprobs=top if ret else 0, seed=spec.sampling_seed if spec.sampling_seed is not None else 0)
        server.finish_sampling(params, spec.ignore_eos, spec.sampling_seed is not None)
        names = {name: f"{where}.{name}" for name in _SAMPLING_FIELDS}
        names.update(prompt=field, seed=f"{where}.sampling_seed", logprobs="top_logprobs_num")
        server.check(prompt, params, names)
        out.append(Item(prompt, params, rids[k], ret, start, top))
    return out, single


def _rids(rid, count: int, ns: list[int], single: bool) -> list[list[str]]:
    """meta_info.id of every completion, prompt by prompt: `rid` for a single answer; a string rid
    with several completions gives "rid_k" for the k-th; a list has one per prompt ("rid_i" for its
    i-th of n > 1); none gives random ids."""
    if rid is None:
        return [[uuid.uuid4().hex for _ in range(n)] for n in ns]
    if isinstance(rid, str) and rid:
        if single:
            return [[rid]]
        starts = [sum(ns[:p]) for p in range(count)]
        return [[f"{rid}_{starts[p] + i}" for i in range(n)] for p, n in enumerate(ns)]
    if isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) and r for r in rid):
        if len(set(rid)) != len(rid):
            raise RequestError(400, "rid: expected distinct ids", "rid")
        return [[r] if n == 1 else [f"{r}_{i}" for i in range(n)] for r, n in zip(rid, ns)]
    raise RequestError(400, f"rid: expected a non-empty string or one per prompt ({count})", "rid")


def finish_reason(out: RequestOutput, params: SamplingParams) -> dict | None:
    """SGLang's finish_reason object of a finished completion."""
    reason = out.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": out.stop_reason}
    if reason == "length":
        return {"type": "length", "length": params.max_new_tokens}
    return {"type": "abort", "message": out.error or reason}


def _triples(values, ids, text_of) -> list:
    return [[v, t, text_of(t) if text_of else None] for v, t in zip(values, ids)]


def _top(steps, text_of) -> list:
    return [[[v, t, text_of(t) if text_of else None] for t, v in step] if step else None for step in steps]


def output(item: Item, index: int, token_ids: list[int], logprobs: list[float], tops: list, text: str,
           finish: dict | None, cached_tokens: int, weight_version: str, prompt_logprobs: dict, prompt_top: dict,
           text_of: Callable[[int], str] | None, latency: float | None = None) -> dict:
    """One completion as /generate answers it (the whole of it so far, in a stream's chunk)."""
    meta = {"id": item.ids[index], "finish_reason": finish, "prompt_tokens": len(item.prompt),
            "weight_version": weight_version, "completion_tokens": len(token_ids), "cached_tokens": cached_tokens}
    if latency is not None:
        meta["e2e_latency"] = latency
    if item.return_logprob:
        meta["output_token_logprobs"] = _triples(logprobs, token_ids, text_of)
        if item.top_logprobs_num:
            meta["output_top_logprobs"] = _top(tops, text_of)
        if item.logprob_start_len >= 0:
            positions = range(item.logprob_start_len, len(item.prompt))
            meta["input_token_logprobs"] = _triples([prompt_logprobs[t] for t in positions],
                                                    [item.prompt[t] for t in positions], text_of)
            if item.top_logprobs_num:
                meta["input_top_logprobs"] = _top([prompt_top[t] for t in positions], text_of)
    return {"text": text, "output_ids": list(token_ids), "meta_info": meta}
