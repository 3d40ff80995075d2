"""What one scheduler step hands to the model runner (vLLM V1's ``sched/output.py``).

Plain dataclasses, no torch import.  The model runner builds input ids, positions, slot
mapping and block tables from these; the scheduler reads them back in
``update_from_output``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The tokens to compute are ``request.all_token_ids[num_computed_tokens :
    num_computed_tokens + num_new_tokens]`` at positions ``num_computed_tokens ..``; token
    at position ``p`` goes to KV slot ``block_ids[p // block_size] * block_size + p %
    block_size``.  The derived fields (``num_tokens``, ``num_spec_tokens``,
    ``needs_sample``, ``is_decode``) are computed once, at construction: every step reads
    them several times per request, and none of their inputs changes afterwards.
    """

    # The request record (shared with the scheduler; read-only for the model runner).
    request: Request
    # Snapshot at schedule time: tokens already in the KV cache, including prefix-cache
    # hits; the position of the first token computed this step (tokens).
    num_computed_tokens: int
    # Tokens to compute this step: a prefill chunk, or 1 for a decode (tokens, >= 1).
    num_new_tokens: int
    # The request's whole block table after this step's allocation (a copy; block ids).
    block_ids: list[int]
    # Tokens of this request found in the prefix cache when it was admitted in this very
    # step (tokens; 0 for requests already running).
    num_cached_tokens: int = 0
    # Draft tokens verified by this step (speculative decoding; empty otherwise).  They are
    # the last ``len(spec_token_ids)`` of the ``num_new_tokens`` computed, after the
    # request's last known token, at positions ``num_tokens ..``; their K/V slots are
    # allocated but rolled back by ``update_from_output`` when rejected.  A model-based
    # proposer overwrites the entries (placeholders at schedule time) before the forward.
    spec_token_ids: list[int] = field(default_factory=list)
    # Snapshot of request.num_tokens at schedule time (tokens), so that needs_sample keeps
    # its value after update_from_output appended the sampled token.
    num_tokens: int = field(init=False)
    # Draft tokens verified this step (tokens; 0 without speculation).
    num_spec_tokens: int = field(init=False)
    # True when this step computes the request's last known token, so its logits give the
    # next token (``num_computed_tokens + num_new_tokens - num_spec_tokens == num_tokens``);
    # False for a prefill chunk that stops short of the end.
    needs_sample: bool = field(init=False)
    # True for a decode: one new known token (plus any drafts), past the prompt.
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        req = self.request  # a Request, or a tensor-parallel worker's PlannedRequest (the same counts)
        self.num_tokens = req.num_tokens
        k = self.num_spec_tokens = len(self.spec_token_ids)
        self.needs_sample = self.num_computed_tokens + self.num_new_tokens - k == self.num_tokens
        self.is_decode = self.num_new_tokens - k == 1 and self.num_computed_tokens >= req.num_prompt_tokens

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id


@dataclass
class SchedulerOutput:
    """The plan for one step."""

    # Requests to run this step, running ones first (in admission order), then requests
    # admitted this step (FCFS).  Every request appears at most once.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Sum of num_new_tokens over `scheduled` (tokens); <= max_num_batched_tokens.
    num_batched_tokens: int = 0
    # Requests preempted (recompute) during this step: their blocks are freed and they
    # are back at the front of the waiting queue.  None of them is in `scheduled`.
    preempted_request_ids: list[str] = field(default_factory=list)
    # Ids of requests admitted from the waiting queue this step (new or resumed).
    new_request_ids: list[str] = field(default_factory=list)
    # Tokens of decode steps (one per decoding request) among num_batched_tokens.
    num_decode_tokens: int = 0
    # Tokens of prefill chunks (prompt, or recomputation after preemption) (tokens).
    num_prefill_tokens: int = 0
    # Planned asynchronously (``schedule`` advanced ``num_computed_tokens`` and appended
    # placeholders); False for a synchronous step, which every step verifying drafts is.
    async_step: bool = False
    # Draft tokens among num_batched_tokens (speculative decoding; tokens).
    num_spec_tokens: int = 0

    @property
    def num_scheduled(self) -> int:
        """Requests in this step (sequences)."""
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled (nothing to run)."""
        return not self.scheduled
