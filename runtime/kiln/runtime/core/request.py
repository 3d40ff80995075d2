"""One record per request as the scheduler sees it (nano-vllm's ``Sequence``, vLLM V1's
``Request``).  Plain Python: no torch import."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


# Stands in ``output_token_ids`` for a token that a step in flight on the device will
# sample (asynchronous scheduling); replaced by the real id when that step's output is read.
PLACEHOLDER_TOKEN_ID = -1


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request.  Order means something: every status greater than
    ``PREEMPTED`` is finished (vLLM V1 uses the same trick)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the model's context length reached
    FINISHED_ABORTED = 5  # client went away or the request was cancelled

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` for a finished status, else None."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(eq=False)
class Request:
    """A request as the scheduler and KV cache manager see it.

    Token accounting (all counts in tokens):
      * ``all_token_ids`` = prompt + generated tokens so far.
      * ``num_computed_tokens``: leading tokens of ``all_token_ids`` whose K/V are in the
        KV cache (including tokens found through the prefix cache).  A request needs a
        new token sampled when, after a step, ``num_computed_tokens == num_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    # Upper bound on generated tokens (already clipped to the model's context length).
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Number of tokens found in the prefix cache at the last admission (for metrics).
    num_cached_tokens: int = 0
    # Number of times this request was preempted (recompute).
    num_preemptions: int = 0
    # Trailing entries of ``output_token_ids`` that are placeholders for tokens still being
    # sampled on the device (asynchronous scheduling; at most 2).
    num_output_placeholders: int = 0
    # Monotonic time of the first scheduling (arrival -> this is the queue time); None
    # while still queued for the first time.
    first_scheduled_time: float | None = None
    # The LoRA adapter computing this request (``LoRAManager``'s lora_id; 0: the base
    # model).  Its KV blocks are cached under a key of their own.
    lora_id: int = 0
    # Draft tokens proposed for the next step (speculative decoding), not yet verified: they
    # are never part of ``output_token_ids`` and never hashed into the prefix cache.  The
    # scheduler takes (a prefix of) them into the next decode step and clears the list; a
    # model-based proposer sets placeholders here and fills the scheduled copy.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_real_output_tokens(self) -> int:
        """Generated tokens whose ids are known on the host (placeholders excluded)."""
        return len(self.output_token_ids) - self.num_output_placeholders

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_num_tokens(self) -> int:
        """Largest length this request can reach (prompt + max_tokens)."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating prompt and output (O(end-start))."""
        np_ = len(self.prompt_token_ids)
        if end <= np_:
            return self.prompt_token_ids[start:end]
        if start >= np_:
            return self.output_token_ids[start - np_ : end - np_]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - np_]

    def token_at(self, pos: int) -> int:
        """``all_token_ids[pos]`` in O(1)."""
        np_ = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < np_ else self.output_token_ids[pos - np_]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def append_output_tokens(self, token_ids: list[int]) -> None:
        """Append a verified run of tokens (speculative decoding: accepted drafts + one)."""
        self.output_token_ids.extend(token_ids)

    def append_placeholder(self) -> None:
        """Reserve the next output position for a token sampled by a step in flight."""
        self.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self.num_output_placeholders += 1

    def fill_placeholder(self, pos: int, token_id: int) -> None:
        """Put the sampled ``token_id`` at absolute position ``pos`` (tokens), which must
        hold a placeholder.  Raises ValueError otherwise."""
        i = pos - len(self.prompt_token_ids)
        if not 0 <= i < len(self.output_token_ids) or self.output_token_ids[i] != PLACEHOLDER_TOKEN_ID:
            raise ValueError(f"request {self.request_id}: no placeholder at position {pos}")
        self.output_token_ids[i] = token_id
        self.num_output_placeholders -= 1

    def drop_placeholders(self) -> None:
        """Remove unresolved trailing placeholders (the request finished; their steps'
        tokens are discarded)."""
        while self.num_output_placeholders and self.output_token_ids \
                and self.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            self.output_token_ids.pop()
            self.num_output_placeholders -= 1
        self.num_output_placeholders = 0
