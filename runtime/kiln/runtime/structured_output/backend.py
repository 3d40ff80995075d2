"""xgrammar behind Kiln's words: a compiler with an LRU cache of compiled grammars keyed by
spec, compiling on a worker thread (off the engine core's step loop), and per-sequence
grammar state.

Why xgrammar (``docs/benchmarks.md``, ``benchmarks/grammar_mask_cost.py``): on this CPU, for
a typical schema and SmolLM2's 49152-token vocabulary, its per-token mask fill is ~1.7 us
median (11 us p90) against llguidance's ~20 us (128 us p90); it runs on CPU-only hosts and
ships Linux x86-64 / aarch64 wheels for Python 3.9-3.13.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .spec import GrammarSpec, build_grammar

log = logging.getLogger(__name__)

#: Compiled grammars the core keeps (LRU); a compiled JSON schema is ~0.1-1 MB.
DEFAULT_CACHE_SIZE = 256


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


class GrammarCompilerCache:
    """Compiles specs for one vocabulary and keeps the last ``cache_size`` compiled grammars.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the logits' width (may exceed the tokenizer's length: padded rows).
        stop_token_ids: the ids that end a sequence (EOS); a finished grammar allows only
            these.
        cache_size: compiled grammars kept (LRU).
        max_threads: xgrammar's compile threads per grammar.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 1):
        import xgrammar as xgr  # noqa: PLC0415

        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        # xgrammar's own cache is off: this class's LRU is the one place compiled grammars live.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        # specs compiling now: a second caller of one waits for that compile (the ``n``
        # sequences of one request, or requests sent together, share one compile)
        self._compiling: dict[GrammarSpec, Future] = {}
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.num_compiles = 0

    def get(self, spec: GrammarSpec):
        """The compiled grammar of ``spec``: from the cache, from the compile of it already
        running on another thread, or compiled now.

        Raises:
            ValueError: the spec does not compile (xgrammar's message).
        """
        with self._lock:
            cg = self._cache.get(spec)
            if cg is not None:
                self._cache.move_to_end(spec)
                return cg
            running = self._compiling.get(spec)
            if running is None:
                mine = self._compiling[spec] = Future()
        if running is not None:
            return running.result()
        try:
            cg = self._compiler.compile_grammar(build_grammar(spec))
        except BaseException as e:
            with self._lock:
                del self._compiling[spec]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._compiling[spec]
            self.num_compiles += 1
            self._cache[spec] = cg
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        mine.set_result(cg)
        return cg

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache


#: Compile threads: a grammar that compiles for long holds one, the others keep compiling.
COMPILE_THREADS = 2


class AsyncGrammarCompiler:
    """Compiles on ``COMPILE_THREADS`` worker threads, so the step loop never waits for a
    compile (xgrammar cannot stop a compile once started: a refused one runs to its end).

    ``tokenizer_loader`` is called once, on the worker, the first time a grammar is needed
    (the engine core loads the tokenizer only when some request asks for structured output).
    """

    def __init__(self, tokenizer_loader, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE):
        self._loader = tokenizer_loader
        self._vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._cache_size = cache_size
        self._cache: GrammarCompilerCache | None = None
        self._cache_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="kiln-grammar")
        self.ready_at: float | None = None  # monotonic time the tokenizer setup ended (None before)

    def _compile(self, spec: GrammarSpec, started: list[float]):
        with self._cache_lock:
            if self._cache is None:  # the tokenizer's setup, once (seconds): not the grammar's time
                self._cache = GrammarCompilerCache(self._loader(), self._vocab_size, self._stop, self._cache_size)
                self.ready_at = time.monotonic()
        started.append(time.monotonic())
        try:
            return self._cache.get(spec)
        finally:
            started.append(time.monotonic())

    def submit(self, spec: GrammarSpec) -> tuple[Future, list[float]]:
        """A future of the compiled grammar (its exception: ValueError for a bad spec), and a
        list that gets the monotonic times its compile started and ended."""
        started: list[float] = []
        return self._pool.submit(self._compile, spec, started), started

    @property
    def num_compiles(self) -> int:
        """Grammars compiled so far (a spec found in the cache or compiling already is not
        compiled again)."""
        return self._cache.num_compiles if self._cache is not None else 0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sequence's position in its grammar (an xgrammar ``GrammarMatcher``).

    The verbs are the ones speculative decoding needs: ``accept_tokens`` advances over a run
    of tokens and says how many were legal, ``rollback`` undoes the last ``n`` accepted
    tokens (xgrammar keeps the whole history), ``fill_bitmask`` writes the legal next tokens.

    Args:
        compiled: an xgrammar ``CompiledGrammar``.
    """

    def __init__(self, compiled):
        import xgrammar as xgr  # noqa: PLC0415

        self._m = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Advance over ``token_ids`` in order; returns how many were accepted (stops at the
        first illegal one, which leaves the state as before it)."""
        n = 0
        for t in token_ids:
            if not self._m.accept_token(int(t)):
                break
            n += 1
        self.num_accepted += n
        return n

    def accept_token(self, token_id: int) -> bool:
        """Advance over one token; False (the state unchanged) when it is illegal here."""
        ok = self._m.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self._m.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the legal next tokens into ``bitmask[row]`` (int32 [R, ceil(V/32)], host):
        bit ``t % 32`` of word ``t // 32`` is 1 when token t may come next."""
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def matcher(self):
        """The xgrammar ``GrammarMatcher`` (for the batch fill, ``bitmask.BitmaskFiller``)."""
        return self._m

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self._m.is_terminated()
