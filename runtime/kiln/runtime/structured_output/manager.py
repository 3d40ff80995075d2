"""The engine core's structured-output bookkeeping: compiles in flight, one grammar state per
sequence, and the batch's token bitmask.

Flow (vLLM V1's structured-output manager): a request with a grammar waits here, outside
the scheduler, until its grammar is compiled (``poll``); once admitted, every step that
samples it gets a bitmask row from its state (``start_fill``: filled on a worker thread
while the step loop goes on, ``bitmask.BitmaskFiller``), the sampler masks its logits, and
the sampled token advances the state (``accept``).  ``free`` drops the state when the
sequence ends, however it ends.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from .backend import AsyncGrammarCompiler, GrammarState, bitmask_width
from .bitmask import BitmaskFiller, GrammarMask
from .spec import GrammarSpec

log = logging.getLogger(__name__)

#: ``StructuredOutputManager.accept``'s verdicts on a sampled token.
ACCEPTED, REFUSED, COMPLETE = 0, 1, 2


class StructuredOutputManager:
    """Grammars of the core's live sequences.

    Args:
        tokenizer_loader: returns the model's tokenizer (called once, on the compile thread).
        vocab_size: the logits' width.
        stop_token_ids: EOS ids (a complete grammar allows only these).
        pin_memory: allocate bitmasks in pinned host memory (CUDA: asynchronous uploads).
        compile_timeout: seconds of compiling after which a grammar is refused.
        fill_threads: C++ threads of one step's bitmask fill (default:
            ``bitmask.default_fill_threads()``).
    """

    def __init__(self, tokenizer_loader, vocab_size: int, stop_token_ids: list[int], pin_memory: bool = False,
                 compile_timeout: float = 10.0, fill_threads: int | None = None):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.pin_memory = pin_memory
        self._compiler = AsyncGrammarCompiler(tokenizer_loader, vocab_size, stop_token_ids)
        self._stop: frozenset[int] | None = None  # the compiled grammars' stop tokens
        self.compile_timeout = compile_timeout
        self._pending: dict[str, tuple[Future, list[float], float]] = {}  # id -> (compile, [start], submit)
        self._states: dict[str, GrammarState] = {}
        self._fill_threads = fill_threads
        self._filler: BitmaskFiller | None = None  # made at the first step with a grammar row

    # -- admission -------------------------------------------------------------------------
    def submit(self, request_id: str, spec: GrammarSpec) -> None:
        """Start compiling ``spec`` for a sequence (it waits until ``poll`` reports it)."""
        self._pending[request_id] = (*self._compiler.submit(spec), time.monotonic())

    def poll(self) -> tuple[list[tuple[str, float]], list[tuple[str, str]]]:
        """Sequences whose compile ended since the last call: ``([(id, seconds since
        submit)], [(id, error message)])``; a ready one has its grammar state from now on.
        A grammar still compiling ``compile_timeout`` seconds after its compile started fails,
        and so does one whose compile took longer than that (its end is seen late when the
        compile held the interpreter lock); xgrammar cannot stop a compile: it runs on to its
        end on its thread, its result cached.  A grammar that waited ``compile_timeout``
        seconds for a compile thread (each busy with an earlier grammar, counted from the
        tokenizer's setup) fails too and never compiles, so no request waits unbounded."""
        ready, failed = [], []
        now = time.monotonic()
        setup = self._compiler.ready_at
        for rid, (fut, started, t0) in list(self._pending.items()):
            if not started and setup is not None and now - max(t0, setup) > self.compile_timeout and fut.cancel():
                del self._pending[rid]
                failed.append((rid, f"the grammar waited {self.compile_timeout:g} s (--grammar-compile-timeout) "
                                    "for a compile thread, each busy with an earlier grammar: retry later"))
                continue
            done = fut.done()
            took = (started[1] if len(started) > 1 else now) - started[0] if started else 0.0
            if took > self.compile_timeout and not (done and fut.exception() is not None):
                del self._pending[rid]
                failed.append((rid, f"the grammar did not compile within {self.compile_timeout:g} s "
                                    "(--grammar-compile-timeout): simplify the schema, regex or grammar"))
                continue
            if not done:
                continue
            del self._pending[rid]
            try:
                compiled = fut.result()
                if self._stop is None:  # xgrammar's (EOS ids, or the tokenizer's when none are given)
                    self._stop = frozenset(compiled.tokenizer_info.stop_token_ids)
                self._states[rid] = GrammarState(compiled)
                ready.append((rid, now - t0))
            except Exception as e:  # a spec the API process let through but the core cannot compile
                failed.append((rid, str(e)))
        return ready, failed

    def wait_any(self, timeout: float) -> None:
        """Block until some pending compile finishes or ``timeout`` seconds pass."""
        if self._pending:
            wait([p[0] for p in self._pending.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._states

    # -- steps -----------------------------------------------------------------------------
    def start_fill(self, request_ids: list[str], drafts: dict[str, list[int]] | None = None) -> GrammarMask | None:
        """Start filling the bitmask rows of those of ``request_ids`` (a step's sampled
        sequences) that have a grammar; returns at once (the fill runs on a worker thread)
        with the step's :class:`GrammarMask`, or None when no row is constrained.  Rows of
        sequences without a grammar get no bitmask row.  A sequence with ``drafts[id]`` (the
        draft tokens it verifies this step) gets a row per position.  (A complete grammar's
        state is gone already: ``accept`` drops it.)"""
        ids, matchers, runs = [], [], []
        drafts = drafts or {}
        for rid in request_ids:
            st = self._states.get(rid)
            if st is None:
                continue
            if drafts.get(rid):
                runs.append((rid, st.matcher, drafts[rid]))
            else:
                ids.append(rid)
                matchers.append(st.matcher)
        if not ids and not runs:
            return None
        if self._filler is None:
            self._filler = BitmaskFiller(self.width, self.pin_memory, self._fill_threads)
        return self._filler.start(ids, matchers, runs)

    @property
    def filler(self) -> BitmaskFiller | None:
        """The bitmask filler (its fill and wait times), None before the first fill."""
        return self._filler

    def accept(self, request_id: str, token_id: int) -> int:
        """Advance a sequence's grammar by its sampled token: ``REFUSED`` when the grammar
        refuses it (the state unchanged), ``COMPLETE`` when it ended the grammar (a stop
        token where the grammar may end; the state is dropped: nothing follows), else
        ``ACCEPTED`` (also for a sequence without a grammar)."""
        st = self._states.get(request_id)
        if st is None:
            return ACCEPTED
        if not st.accept_token(token_id):
            return REFUSED
        if token_id in self._stop and st.is_terminated:  # only a stop token ends a grammar
            del self._states[request_id]
            return COMPLETE
        return ACCEPTED

    def free(self, request_id: str) -> None:
        """Forget a sequence (finished, aborted, or refused): its state or pending compile."""
        self._states.pop(request_id, None)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending[0].cancel()

    @property
    def num_states(self) -> int:
        return len(self._states)

    @property
    def num_compiles(self) -> int:
        """Grammars compiled so far; specs met again come from the compile cache."""
        return self._compiler.num_compiles

    def shutdown(self) -> None:
        self._compiler.shutdown()
        if self._filler is not None:
            self._filler.shutdown()
