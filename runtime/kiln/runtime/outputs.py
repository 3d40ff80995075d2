"""What the engine returns: one ``RequestOutput`` per request with ``n`` completions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability (natural log, of the model's raw distribution) of one token."""

    token_id: int
    logprob: float
    decoded: str


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[Logprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One completion.  ``text`` is the full text so far (stop strings excluded);
    ``finish_reason`` is None while running, else "stop", "length" or "abort"."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    # What this step added (for streaming): text safe to emit and the new token ids.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: the prompt and its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
