"""One asyncio engine loop serving every HTTP request.

The loop task owns the :class:`LLMEngine`.  Each ``step()`` runs in a single worker thread
(torch releases the GIL, so the event loop keeps answering HTTP meanwhile); requests and
aborts arriving during a step are queued and applied between steps, so engine state is only
ever touched by one thread at a time.  Each request gets an ``asyncio.Queue`` of outputs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from ..engine import InvalidRequestError, LLMEngine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival: float
    queue: asyncio.Queue
    accepted: asyncio.Future


class AsyncEngine:
    """Async front of an :class:`LLMEngine`.

    ``generate()`` yields cumulative :class:`RequestOutput` snapshots (with per-step deltas)
    until the request finishes; cancelling the iterator (client gone) aborts the request
    and frees its KV blocks.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-step")
        # Tokenization and chat templates run here, off the event loop (a long prompt takes
        # seconds; the HF tokenizer releases the GIL) and one at a time (vLLM does the same).
        self._tok_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-tokenize")
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[_Pending] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.errored: BaseException | None = None
        # Called (in the event loop) after aborts change the engine's state between steps.
        self.on_change = None
        self.ready = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kiln-engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._tok_executor.shutdown(wait=False, cancel_futures=True)

    async def run_tokenizer(self, fn, *args):
        """``fn(*args)`` in the tokenizer thread (tokenizing, chat templates)."""
        return await asyncio.get_running_loop().run_in_executor(self._tok_executor, fn, *args)

    async def warmup(self) -> None:
        """Run one real request through the engine (readiness means a step has run)."""
        ids = self.engine.tokenizer.encode("Hello") if self.engine.tokenizer is not None else [1]
        ids = (ids or [0])[: max(1, self.engine.max_model_len - 2)]  # fits a tiny max_model_len
        max_tokens = max(1, min(2, self.engine.max_model_len - len(ids)))
        async for _ in self.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), "warmup"):
            pass
        self.ready = True

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate over its outputs.

        Raises:
            InvalidRequestError: the engine refused the request (HTTP 400).
            RuntimeError: the engine loop died.
        """
        if self.errored is not None:
            raise RuntimeError(f"engine loop failed: {self.errored!r}")
        if isinstance(prompt, str):  # tokenize here, not in the engine loop (raises InvalidRequestError)
            prompt = (await self.run_tokenizer(self.engine.tokenize_prompt, prompt))[1]
        loop = asyncio.get_running_loop()
        rid = request_id or self.engine.new_request_id()
        q: asyncio.Queue = asyncio.Queue()
        pend = _Pending(rid, prompt, params, time.monotonic(), q, loop.create_future())
        self._pending.append(pend)
        self._wake.set()
        await pend.accepted  # raises InvalidRequestError
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"engine loop failed: {item!r}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request (applied before the next step)."""
        self._aborts.append(request_id)
        self._wake.set()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            if p.accepted.done():  # caller went away before we got to it
                continue
            try:
                self.engine.add_request(p.request_id, p.prompt, p.params, arrival_time=p.arrival)
            except InvalidRequestError as e:
                p.accepted.set_exception(e)
                continue
            except Exception as e:  # unexpected: report as a server error, keep serving
                log.exception("add_request failed")
                p.accepted.set_exception(e)
                continue
            self._queues[p.request_id] = p.queue
            p.accepted.set_result(None)
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            self.engine.abort_request(rid)
            self._queues.pop(rid, None)
        if aborts and self.on_change is not None:
            self.on_change()  # gauges must not wait for the next step to show the abort

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    if self._pending or self._aborts:
                        continue
                    await self._wake.wait()
                    continue
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                        if out.finished:
                            self._queues.pop(out.request_id, None)
                # Let HTTP handlers run between steps.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the engine is broken: fail every waiter, stop readiness
            log.exception("engine loop crashed")
            self.errored = e
            self.ready = False
            for q in self._queues.values():
                q.put_nowait(e)
            for p in self._pending:
                if not p.accepted.done():
                    p.accepted.set_exception(RuntimeError(f"engine loop failed: {e!r}"))
