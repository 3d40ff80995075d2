"""The output processor: the core's new token ids -> :class:`RequestOutput` snapshots.

Per request it keeps the ``n`` completions: incremental detokenization (UTF-8 safe), stop
strings, logprob texts and the streaming deltas.  Token-level endings (EOS, stop token ids,
``max_tokens``, the context) are decided by the engine core; a stop string is found here, and
the sequence is then reported for abort so the core frees its KV blocks (vLLM V1's
``OutputProcessor`` does the same).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..detokenizer import IncrementalDetokenizer
from ..engine_core.messages import CoreOutput
from ..outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from ..sampling_params import SamplingParams


def child_id(request_id: str, index: int) -> str:
    """The core's id of completion ``index`` of a request."""
    return f"{request_id}#{index}"


@dataclass
class _Completion:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class RequestState:
    """One request in the API process: its prompt, settings and completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    completions: list[_Completion]
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    @property
    def child_ids(self) -> list[str]:
        return [child_id(self.request_id, c.index) for c in self.completions]


class OutputProcessor:
    """Turns :class:`CoreOutput` batches into :class:`RequestOutput` per request.

    Args:
        tokenizer: a transformers tokenizer, or None (token ids only).
        stream_outputs: True: an output for every request that progressed (streaming);
            False: only for finished requests (the offline ``LLM``).
    """

    def __init__(self, tokenizer, stream_outputs: bool = True):
        self.tokenizer = tokenizer
        self.stream_outputs = stream_outputs
        self._requests: dict[str, RequestState] = {}
        self._child: dict[str, tuple[RequestState, _Completion]] = {}
        self.detokenize_seconds = 0.0  # time spent in process_outputs (detokenization, stop strings)

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> RequestState:
        """Track a request whose ``params.n`` sequences were sent to the core."""
        comps = []
        for i in range(params.n):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                               params.stop)
            comps.append(_Completion(i, detok, logprobs=[] if params.logprobs is not None else None))
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, arrival_time, comps)
        self._requests[request_id] = state
        for c in comps:
            self._child[child_id(request_id, c.index)] = (state, c)
        return state

    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished sequence ids (for the core to abort)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        live = []
        for c in state.completions:
            cid = child_id(request_id, c.index)
            self._child.pop(cid, None)
            if c.finish_reason is None:
                c.finish_reason = "abort"
                live.append(cid)
        return live

    def process_outputs(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one core step.

        Returns:
            ``(request outputs, sequence ids to abort in the core)``: the outputs of requests
            that progressed (only finished ones unless ``stream_outputs``), and the sequences
            that a stop string ended here.
        """
        t0 = time.perf_counter()
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            pc = self._child.get(out.request_id)
            if pc is None:
                continue  # aborted while the step ran
            state, comp = pc
            if comp.finish_reason is not None:
                continue
            if state.first_scheduled_time is None and out.first_scheduled_time is not None:
                state.first_scheduled_time = out.first_scheduled_time
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if self._on_tokens(state, comp, out):
                to_abort.append(out.request_id)
            if comp.index == 0:
                if state.first_token_time is None:
                    state.first_token_time = now
                state.last_token_time = now
            touched[state.request_id] = state
        results = [self._make_output(s) for s in touched.values() if self.stream_outputs or s.finished]
        for s in touched.values():
            if s.finished:
                self._requests.pop(s.request_id, None)
                for cid in s.child_ids:
                    self._child.pop(cid, None)
        self.detokenize_seconds += time.perf_counter() - t0
        return results, to_abort

    def _on_tokens(self, state: RequestState, comp: _Completion, out: CoreOutput) -> bool:
        """Append a step's tokens to a completion; True when a stop string ended it here."""
        params = state.params
        last = len(out.new_token_ids) - 1
        for j, tok in enumerate(out.new_token_ids):
            comp.token_ids.append(tok)
            comp.pending_tokens.append(tok)
            if out.new_logprobs is not None and comp.logprobs is not None:
                sampled_lp, top = out.new_logprobs[j]
                tl = TokenLogprobs(tok, sampled_lp, [Logprob(t, v, self._decode_one(t)) for t, v in top])
                comp.logprobs.append(tl)
                comp.pending_logprobs.append(tl)
            final = j == last and out.finish_reason is not None
            if comp.detok is None:
                continue
            if final and out.finish_reason == "stop":
                break  # EOS or a stop token id: not part of the text
            matched = comp.detok.add_token(tok, check_stop=len(comp.token_ids) >= params.min_tokens)
            if matched is not None:
                comp.finish_reason, comp.stop_reason = "stop", matched
                return True
        if out.finish_reason is not None:
            comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
            if comp.detok is not None:
                comp.detok.flush()
        return False

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _make_output(self, s: RequestState) -> RequestOutput:
        comps = []
        for c in s.completions:
            delta_ids, c.pending_tokens = c.pending_tokens, []
            delta_lps, c.pending_logprobs = c.pending_logprobs, []
            done = c.finish_reason is not None
            comps.append(CompletionOutput(
                index=c.index, text=c.detok.text if c.detok is not None else "",
                token_ids=list(c.token_ids) if done else c.token_ids,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason, logprobs=c.logprobs,
                delta_text=c.detok.take_delta(done) if c.detok is not None else "",
                delta_token_ids=delta_ids, delta_logprobs=delta_lps,
            ))
        metrics = {"arrival_time": s.arrival_time, "last_token_time": s.last_token_time}
        if s.first_token_time is not None:
            metrics["first_token_time"] = s.first_token_time
        if s.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = s.first_scheduled_time
        return RequestOutput(s.request_id, s.prompt, s.prompt_token_ids, comps, finished=s.finished,
                             num_cached_tokens=s.num_cached_tokens, metrics=metrics)
