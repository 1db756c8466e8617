"""One check of a request, shared by the engine and the HTTP servers.

`Engine.add_request` runs it on every request (a bad one finishes with finish_reason "error"), and
`lockstep serve` runs it before it queues anything (a bad one gets a 400). Both say the same thing:
an `InvalidRequest`, a ValueError whose message starts with the offending field, "prompt: ...".
A server names the fields as its API spells them through `names` ({"max_new_tokens": "max_tokens"}),
so the message and the error body's `param` name what the client sent.

What is checked: the prompt (token ids in the vocabulary, or a string and a tokenizer; at least one
token), the SamplingParams (`SamplingParams.validate`), the model's context (the prompt and
max_new_tokens together), the KV cache (a request must fit in it alone), and stop strings (they
need a tokenizer). The check reads the model's tokenizer and a `RequestLimits`, which the engine
builds once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping
from typing import Sequence as Seq

from ..numerics.fixed_order import ceil_div
from ..sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the model's vocabulary and context (max_len tokens), and the KV
    cache's num_blocks blocks of block_size tokens."""
    vocab_size: int
    max_len: int
    block_size: int
    num_blocks: int


class InvalidRequest(ValueError):
    """A request refused: `field` is the offending field (as the caller's API names it); the message
    is "field: why"."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def _renamer(names: Mapping[str, str] | None):
    return (lambda field: names.get(field, field)) if names else (lambda field: field)


def encode_prompt(prompt: Seq[int] | str, tokenizer, vocab_size: int, field: str = "prompt") -> list[int]:
    """A prompt as token ids (a string through `tokenizer`), checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest(field, "a string needs a model with a tokenizer; pass token ids")
        ids = tokenizer.encode(prompt)
    else:
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest(field, "expected token ids (ints) or a string")
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequest(field, "expected at least one token, got an empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(field, f"token ids must be in [0, {vocab_size}), got {bad[:5]}")
    return ids


def validate_request(limits: RequestLimits, tokenizer, prompt: Seq[int] | str, sampling: SamplingParams,
                     names: Mapping[str, str] | None = None) -> list[int]:
    """The prompt's token ids, once the request is known to fit `limits` (an engine's model, context
    and KV cache: `Engine.limits`) and the model's `tokenizer` (None: token ids only); else an
    InvalidRequest naming the field, renamed through `names`."""
    name = _renamer(names)
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequest(name("sampling"), f"expected a SamplingParams, got {type(sampling).__name__}")
    ids = encode_prompt(prompt, tokenizer, limits.vocab_size, name("prompt"))
    try:
        sampling.validate(limits.vocab_size)
    except ValueError as e:                       # SamplingParams' messages start with the field too
        field, _, reason = str(e).partition(": ")
        raise InvalidRequest(name(field), reason) from None
    n, new, context = len(ids), sampling.max_new_tokens, limits.max_len
    if n >= context:
        raise InvalidRequest(name("prompt"), f"{n} tokens + at least 1 new token exceed the model's context of "
                                             f"{context}")
    if n + new > context:
        raise InvalidRequest(name("max_new_tokens"), f"{new} new tokens after a {n}-token prompt exceed the "
                                                     f"model's context of {context} (at most {context - n})")
    need, have = ceil_div(n + new, limits.block_size), limits.num_blocks
    if need > have:
        field = "prompt" if ceil_div(n + 1, limits.block_size) > have else "max_new_tokens"
        raise InvalidRequest(name(field), f"the request needs {need} KV-cache blocks ({n} + {new} tokens), the "
                                          f"cache has {have}")
    if sampling.stop and tokenizer is None:
        raise InvalidRequest(name("stop"), "stop strings need a model with a tokenizer; use stop_token_ids")
    return ids
