"""The engine core's structured-output bookkeeping: compiles in flight, one grammar state per
sequence, and the batch's token bitmask.

Flow (vLLM V1's structured-output manager): a request with a grammar waits here, outside
the scheduler, until its grammar is compiled (``poll``); once admitted, every step that
samples it gets a bitmask row from its state (``fill_bitmask``, on the host, while the
step's forward pass runs on the device), the sampler masks its logits, and the sampled
token advances the state (``accept``).  ``free`` drops the state when the sequence ends,
however it ends.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from .backend import AsyncGrammarCompiler, GrammarState, bitmask_width
from .spec import GrammarSpec

log = logging.getLogger(__name__)


class StructuredOutputManager:
    """Grammars of the core's live sequences.

    Args:
        tokenizer_loader: returns the model's tokenizer (called once, on the compile thread).
        vocab_size: the logits' width.
        stop_token_ids: EOS ids (a complete grammar allows only these).
        pin_memory: allocate bitmasks in pinned host memory (CUDA: asynchronous uploads).
        max_rollback_tokens: rollback depth of each state (speculative decoding's draft length).
    """

    def __init__(self, tokenizer_loader, vocab_size: int, stop_token_ids: list[int], pin_memory: bool = False,
                 max_rollback_tokens: int = 0):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.pin_memory = pin_memory
        self.max_rollback_tokens = max_rollback_tokens
        self._compiler = AsyncGrammarCompiler(tokenizer_loader, vocab_size, stop_token_ids)
        self._pending: dict[str, Future] = {}
        self._states: dict[str, GrammarState] = {}

    # -- admission -------------------------------------------------------------------------
    def submit(self, request_id: str, spec: GrammarSpec) -> None:
        """Start compiling ``spec`` for a sequence (it waits until ``poll`` reports it)."""
        self._pending[request_id] = self._compiler.submit(spec)

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Sequences whose compile finished since the last call: ``(ready ids, [(id,
        error message)])``; a ready one has its grammar state from now on."""
        ready, failed = [], []
        for rid, fut in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[rid]
            try:
                self._states[rid] = GrammarState(fut.result(), self.max_rollback_tokens)
                ready.append(rid)
            except Exception as e:  # a spec the API process let through but the core cannot compile
                failed.append((rid, str(e)))
        return ready, failed

    def wait_any(self, timeout: float) -> None:
        """Block until some pending compile finishes or ``timeout`` seconds pass."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._states

    # -- steps -----------------------------------------------------------------------------
    def fill_bitmask(self, request_ids: list[str]) -> torch.Tensor | None:
        """The token bitmask of a step's sampled rows, in ``request_ids`` order: int32
        [R, ceil(V/32)] on the host (pinned when configured), all ones for rows without a
        grammar (or whose grammar has terminated); None when no row has one."""
        rows = [(i, self._states[rid]) for i, rid in enumerate(request_ids) if rid in self._states]
        if not rows:
            return None
        bm = torch.full((len(request_ids), self.width), -1, dtype=torch.int32, pin_memory=self.pin_memory)
        for i, st in rows:
            if not st.is_terminated:
                st.fill_bitmask(bm, i)
        return bm

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance a sequence's grammar by its sampled token; False when the grammar refuses
        it (True for a sequence without a grammar)."""
        st = self._states.get(request_id)
        if st is None or st.is_terminated:
            return True
        return st.accept_tokens([token_id]) == 1

    def is_terminated(self, request_id: str) -> bool:
        st = self._states.get(request_id)
        return st is not None and st.is_terminated

    def free(self, request_id: str) -> None:
        """Forget a sequence (finished, aborted, or refused): its state or pending compile."""
        self._states.pop(request_id, None)
        fut = self._pending.pop(request_id, None)
        if fut is not None:
            fut.cancel()

    @property
    def num_states(self) -> int:
        return len(self._states)

    def shutdown(self) -> None:
        self._compiler.shutdown()
