"""OpenAI's completions and chat completions request bodies, and lockstep's answers to them.

Request fields are checked by pydantic; an unknown field is refused (a typo must not silently sample
with defaults). The answers follow OpenAI's shapes, with vLLM's `return_token_ids` extension
(`prompt_token_ids`, each choice's `token_ids`) so that a trainer can recompute without
re-tokenizing, and `weights_version`: the version of the weights that produced the answer.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine import RequestOutput
from ..sampling import SamplingParams
from . import compat

MAX_TOP_LOGPROBS = SamplingParams.MAX_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                  # -1 or 0: no top-k (vLLM and lockstep spellings)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    seed: int | None = None
    n: int = Field(1, ge=1, le=SamplingParams.MAX_N)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False                      # vLLM's: do not stop at the model's end-of-sequence tokens
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("expected up to 16 non-empty stop strings")
        return stops

    def sampling(self, max_tokens: int, logprobs: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=max(0, self.top_k), top_p=self.top_p,
                              min_p=self.min_p, repetition_penalty=self.repetition_penalty, max_new_tokens=max_tokens,
                              n=self.n, stop_token_ids=list(self.stop_token_ids), stop=list(self.stop or []),
                              logprobs=logprobs, seed=self.seed if self.seed is not None else 0)


class _Completion(_Sampling):
    """POST /v1/completions: prompt is a string, a list of token ids, or a list of either (and the
    fields of compat.COMPLETIONS at the values that change nothing)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("expected a non-empty prompt")
        return v

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class _ChatCompletion(_Sampling):
    """POST /v1/chat/completions (and the fields of compat.CHAT at the values that change nothing)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


CompletionRequest = compat.with_fields("CompletionRequest", _Completion, compat.COMPLETIONS)
ChatCompletionRequest = compat.with_fields("ChatCompletionRequest", _ChatCompletion, compat.CHAT)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_lengths: list[int], outputs: list[RequestOutput]) -> dict:
    prompt = sum(prompt_lengths)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.cached_tokens for o in outputs if o.index == 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(out: RequestOutput, text_of) -> dict:
    """The legacy completions logprobs object of a completion's tokens."""
    tokens = [text_of(t) for t in out.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None
    if out.top_logprobs:
        top = [{text_of(t): lp for t, lp in step} for step in out.top_logprobs]
    return {"tokens": tokens, "token_logprobs": list(out.logprobs), "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(out: RequestOutput, text_of) -> dict:
    """The chat completions logprobs object of a completion's tokens."""
    content = []
    for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        s = text_of(t)
        entry = {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
        if out.top_logprobs:
            entry["top_logprobs"] = [{"token": text_of(a), "logprob": b, "bytes": list(text_of(a).encode("utf-8"))}
                                     for a, b in out.top_logprobs[i]]
        content.append(entry)
    return {"content": content}


def completion_response(model: str, prompts: list[list[int]], groups: list[list[RequestOutput]], text_of,
                        want_logprobs: bool, return_token_ids: bool, version: int) -> dict:
    choices, flat = [], []
    for p, (prompt, outs) in enumerate(zip(prompts, groups)):
        for out in outs:
            choice = {"index": len(choices), "text": out.text or "", "finish_reason": out.finish_reason,
                      "logprobs": completion_logprobs(out, text_of) if want_logprobs else None}
            if return_token_ids:
                choice["prompt_token_ids"] = prompt
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
            flat.append(out)
    return {"id": _new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([len(p) for p in prompts], flat), "weights_version": version}


def chat_response(model: str, prompt: list[int], outs: list[RequestOutput], text_of, want_logprobs: bool,
                  return_token_ids: bool, version: int) -> dict:
    choices = []
    for out in outs:
        choice = {"index": out.index, "message": {"role": "assistant", "content": out.text or ""},
                  "finish_reason": out.finish_reason, "logprobs": chat_logprobs(out, text_of) if want_logprobs else None}
        if return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        choices.append(choice)
    body = {"id": _new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([len(prompt)], outs), "weights_version": version}
    if return_token_ids:
        body["prompt_token_ids"] = prompt
    return body


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: the message, the offending field, and the kind of error."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
