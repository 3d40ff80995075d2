"""The engine core's structured output: sequences that wait outside the scheduler for their
grammar to compile, the verdicts on them, and each step's grammar work (the bitmask fill
started for the step's constrained rows, the sampled token checked against its grammar).

Step order (``EngineCore.step``): without asynchronous scheduling every grammar holds all
its sequence's tokens before the step is planned, so the step's bitmask fill starts before
its forward pass and runs while it does.  With asynchronous scheduling the step's forward
pass is launched first; then the previous step is read back and its tokens advance the
grammars, the fill starts on the worker thread, and the step's sampler is launched only at
the start of the next step when the fill is done, else before the next forward pass (waiting
for it; ``ModelRunner.execute_async(defer_sample=True)``), so the fill runs while the host
hands out the previous step's outputs and plans the next step.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..core.request import Request, RequestStatus
from ..core.sched_output import SchedulerOutput
from ..errors import InvalidRequestError
from ..structured_output.bitmask import GrammarMask
from ..structured_output.manager import COMPLETE, REFUSED, StructuredOutputManager
from ..structured_output.spec import GrammarSpec

log = logging.getLogger(__name__)


class GrammarAdmission:
    """Grammars of one engine core.

    Args:
        tokenizer: the model's tokenizer (None: structured output is refused).
        vocab_size: the logits' width.
        stop_token_ids: EOS ids (a complete grammar allows only these).
        pin_memory: bitmasks in pinned host memory (CUDA).
        compile_timeout: seconds of compiling after which a grammar is refused.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], pin_memory: bool,
                 compile_timeout: float):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = sorted(stop_token_ids)
        self._pin = pin_memory
        self._timeout = compile_timeout
        #: the manager, made at the first request with a grammar
        self.manager: StructuredOutputManager | None = None
        self._awaiting: dict[str, Request] = {}
        # verdicts since the last ``take``: ids admitted, (id, message) refused
        self._admitted: list[str] = []
        self._refused: list[tuple[str, str]] = []

    def require(self) -> StructuredOutputManager:
        """The manager, made now if needed.

        Raises:
            InvalidRequestError: the model has no tokenizer.
        """
        if self.manager is None:
            tok = self._tokenizer
            if tok is None:
                raise InvalidRequestError("structured output needs the model's tokenizer; this model has none")
            self.manager = StructuredOutputManager(lambda: tok, self._vocab_size, self._stop,
                                                   pin_memory=self._pin, compile_timeout=self._timeout)
        return self.manager

    # -- admission -------------------------------------------------------------------------
    def submit(self, request: Request, spec: GrammarSpec) -> None:
        """Start compiling ``spec``; ``request`` waits here until ``admit`` queues it."""
        self.require().submit(request.request_id, spec)
        self._awaiting[request.request_id] = request

    @property
    def num_awaiting(self) -> int:
        return len(self._awaiting)

    def admit(self, scheduler, seqs: dict, stat_logger, drop: Callable[[str], object], idle: bool) -> None:
        """Queue on ``scheduler`` the sequences whose grammar finished compiling (admitted);
        ``drop`` those whose grammar failed or ran out of time (refused): both are verdicts
        for ``take``.  ``seqs`` are the core's records (``grammar_seconds``,
        ``record_metrics``); ``idle``: nothing else to run, so wait up to 10 ms for a compile
        instead of spinning the step loop."""
        if not self._awaiting:
            return
        if idle:
            self.manager.wait_any(0.01)
        ready, failed = self.manager.poll()
        for rid, _ in ready:
            r = self._awaiting.pop(rid, None)
            seq = seqs.get(rid)
            if r is None or seq is None:
                continue
            seq.grammar_seconds = time.monotonic() - r.arrival_time
            if seq.record_metrics and stat_logger is not None:
                stat_logger.on_grammar_compiled(seq.grammar_seconds)
            scheduler.add_request(r)
            self._admitted.append(rid)
        for rid, msg in failed:
            self._awaiting.pop(rid, None)
            if drop(rid) is None:
                continue
            log.warning("request %s refused: %s", rid, msg)
            self._refused.append((rid, msg))

    def take(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The verdicts since the last call: ``(admitted ids, [(id, why refused)])``."""
        out = (self._admitted, self._refused)
        self._admitted, self._refused = [], []
        return out

    def discard(self, request_id: str) -> None:
        """Forget a sequence (finished or aborted): its wait, compile or grammar state."""
        self._awaiting.pop(request_id, None)
        if self.manager is not None:
            self.manager.free(request_id)

    # -- steps -----------------------------------------------------------------------------
    def has_rows(self, out: SchedulerOutput) -> bool:
        """Some sequence that samples in ``out`` has a grammar."""
        so = self.manager
        return so is not None and so.num_states > 0 and any(
            sr.needs_sample and so.has_grammar(sr.request.request_id) for sr in out.scheduled)

    def start_fill(self, out: SchedulerOutput) -> GrammarMask | None:
        """Start the bitmask fill of ``out``'s sampled sequences with a live grammar (on the
        worker thread), a row per position for those that verify drafts (their drafts must be
        in place: after a model proposer wrote them); None when there is none."""
        if self.manager is None or not self.manager.num_states:
            return None
        drafts = {sr.request.request_id: list(sr.spec_token_ids) for sr in out.scheduled if sr.spec_token_ids}
        return self.manager.start_fill([sr.request.request_id for sr in out.scheduled if sr.needs_sample], drafts)

    def mask_after(self, out: SchedulerOutput, read_back: Callable[[], None]) -> Callable[[], GrammarMask | None]:
        """The ``grammar_mask`` callback of an asynchronous step: ``read_back`` (the previous
        step's tokens advance the grammars), then ``start_fill``."""
        def mask() -> GrammarMask | None:
            read_back()
            return self.start_fill(out)
        return mask

    def check_token(self, request_id: str, token_id: int) -> RequestStatus | None:
        """Advance the sequence's grammar by its sampled token: ``FINISHED_ABORTED`` when the
        grammar refuses it (the mask forbids that: a bug, logged), ``FINISHED_STOPPED`` when
        the grammar is complete, else None."""
        if self.manager is None:
            return None
        verdict = self.manager.accept(request_id, token_id)
        if verdict == REFUSED:
            log.error("request %s: token %d is outside its grammar", request_id, token_id)
            return RequestStatus.FINISHED_ABORTED
        if verdict == COMPLETE:
            return RequestStatus.FINISHED_STOPPED  # the grammar ended (with ignore_eos too)
        return None
