"""A request's ``n`` completions: the engine loop (``LLMEngine``) fans a request with ``n > 1``
out into ``n`` child sequences that share the prompt's KV blocks through the prefix cache,
and gathers their tokens back into one ``RequestOutput`` (vLLM's ``ParentRequest``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .core.request import Request
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput, TokenLogprobs
from .sampling_params import SamplingParams


@dataclass
class ChildSequence:
    """One of the ``n`` completions of a request: its scheduler request and what the engine
    keeps beside it."""

    index: int  # the completion's index in the request (0 .. n-1)
    request: Request  # the sequence the scheduler runs (id ``<request id>#<index>``)
    detok: IncrementalDetokenizer  # text so far and stop-string matching
    generator: torch.Generator | None  # seeded sampling stream; None when unseeded or greedy
    logprobs: list[TokenLogprobs] | None  # every token's logprobs when requested, else None
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or token id that finished it
    last_token_time: float = 0.0  # monotonic seconds of the latest token
    first_token_time: float | None = None  # monotonic seconds of the first token
    pending_tokens: list[int] = field(default_factory=list)  # tokens not yet in an output
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)  # their logprobs
    scheduled_logged: bool = False  # its first scheduling was reported to the stat logger


@dataclass
class ParentRequest:
    """A user's request: the prompt, its sampling settings and its ``n`` child sequences."""

    request_id: str
    prompt: str | None  # the prompt text, None when given as token ids
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # monotonic seconds
    children: list[ChildSequence]

    @property
    def finished(self) -> bool:
        """True when every completion has finished."""
        return all(c.finish_reason is not None for c in self.children)

    def make_output(self) -> RequestOutput:
        """The request's output now, with the tokens and text produced since the last output
        as deltas (which this consumes)."""
        comps = []
        for c in self.children:
            delta_ids, c.pending_tokens = c.pending_tokens, []
            delta_lps, c.pending_logprobs = c.pending_logprobs, []
            # Running requests share the live token list (read-only view); a finished one gets a copy.
            toks = c.request.output_token_ids
            if c.finish_reason or c.request.num_output_placeholders:
                toks = toks[: c.request.num_real_output_tokens]
            comps.append(CompletionOutput(
                index=c.index, text=c.detok.text, token_ids=toks,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason, logprobs=c.logprobs,
                delta_text=c.detok.take_delta(c.finish_reason is not None),
                delta_token_ids=delta_ids, delta_logprobs=delta_lps,
            ))
        cached = max((c.request.num_cached_tokens for c in self.children), default=0)
        c0 = self.children[0]
        metrics = {"arrival_time": self.arrival_time, "last_token_time": c0.last_token_time}
        if c0.first_token_time is not None:
            metrics["first_token_time"] = c0.first_token_time
        if c0.request.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = c0.request.first_scheduled_time
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, comps, finished=self.finished,
                             num_cached_tokens=cached, metrics=metrics)


def mix_seed(seed: int, index: int) -> int:
    """The generator seed of completion ``index`` of a request seeded with ``seed`` (int64):
    SplitMix64's finalizer (Steele, Lea and Flood 2014) over ``seed + index * golden ratio``,
    so seeds that differ only in their high 32 bits (which torch's CPU generator drops) or by
    one completion index still give unrelated streams.  Returns an int in [0, 2**64)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)
