"""A request's completions as the engine tracks them, and what it hands back when one finishes."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import SamplingParams


@dataclass
class RequestOutput:
    """One finished completion. logprobs[i] is the logprob of token_ids[i] (see lockstep.sampling);
    top_logprobs[i] the (token, logprob) pairs most likely at that step, when asked for. A request
    with n completions gives n outputs with the same request_id and index 0..n-1."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None     # "stop", "length", "abort" or "error"
    error: str | None = None
    text: str | None = None
    index: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cached_tokens: int = 0                # prompt tokens whose keys and values came from the prefix cache


@dataclass
class Sequence:
    """One completion being generated: its tokens so far and where their keys and values live."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    out: RequestOutput
    blocks: list[int] = field(default_factory=list)
    computed: int = 0                     # tokens whose keys and values are in the cache
    admitted: bool = False                # scheduled at least once (a preempted one is re-admitted)

    @property
    def index(self) -> int:
        return self.out.index

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out.token_ids

    @property
    def remaining(self) -> int:
        """Tokens whose keys and values are still to compute before the next token can be drawn."""
        return len(self.prompt) + len(self.out.token_ids) - self.computed
