"""The API process's engine: input processing, the core client and output processing.

``generate()`` tokenizes (in a pool of tokenizer threads, so a long prompt does not hold up
other requests), sends the request's sequences to the engine core, waits for the core to
accept them (a refusal raises ``InvalidRequestError`` before any byte of the response is
sent), then yields :class:`RequestOutput` snapshots.  Closing the iterator early (client
gone) aborts the sequences in the core at once.  One task reads the core's outputs; one
watches the core process: when it dies every waiting request fails with
:class:`EngineDeadError` and ``errored`` is set (``/health`` fails).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import psutil

from ..engine_core import messages as m
from ..engine_core.client import AsyncCoreClient, core_alive
from ..errors import EngineDeadError, InvalidRequestError
from ..outputs import RequestOutput
from ..processing.input import InputProcessor, ModelLimits
from ..processing.output import OutputProcessor
from ..sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Tokenizer threads per API process (Hugging Face fast tokenizers release the GIL).
TOKENIZER_WORKERS = 4


@dataclass
class _Waiter:
    queue: asyncio.Queue
    accepted: asyncio.Future
    num_pending: int
    rejected: list[str] = field(default_factory=list)


class AsyncLLM:
    """Serves requests through an engine core in another process.

    Args:
        info: the core's handshake.
        client: the connection to the core.
        tokenizer: the same tokenizer the core's model uses (None: token ids only).
        process_label: this API process's label in the metrics ("api-0", ...).
    """

    def __init__(self, info: m.CoreInfo, client: AsyncCoreClient, tokenizer, process_label: str = "api-0"):
        self.info = info
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_name = info.served_model_name
        self.max_model_len = info.max_model_len
        self.process_label = process_label
        self.input = InputProcessor(tokenizer, ModelLimits(info.max_model_len, info.vocab_size, info.block_size,
                                                          info.num_kv_blocks, info.served_model_name))
        self.output = OutputProcessor(tokenizer, stream_outputs=True)
        self._tok_executor = ThreadPoolExecutor(max_workers=TOKENIZER_WORKERS, thread_name_prefix="kiln-tokenize")
        self._waiters: dict[str, _Waiter] = {}  # request id -> its queue
        self._seq_waiter: dict[str, str] = {}  # sequence id awaiting acceptance -> request id
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()
        self._failures: Counter[str] = Counter()
        self._detok_reported = 0.0
        self._proc = psutil.Process()
        self.errored: BaseException | None = None
        self.ready = False
        # Called once the core is found dead (after every waiting request has failed).
        self.on_dead = None
        # LoRA adapters the core serves (updated by the core when they change) and the
        # load/unload calls of this process waiting for the core's answer.
        self.lora_enabled = info.lora_enabled
        self.lora_adapters: list[m.LoRAAdapter] = list(info.lora_adapters)
        self._lora_waiters: dict[int, asyncio.Future] = {}
        self._lora_tokens = itertools.count(1)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._output_loop(), name="kiln-core-outputs"),
                       loop.create_task(self._watch_core(), name="kiln-core-watch"),
                       loop.create_task(self._report_stats(), name="kiln-api-stats")]
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tok_executor.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def count_failure(self, reason: str) -> None:
        """Count a request that failed in this process (``kiln_request_failure_total``)."""
        self._failures[reason] += 1

    async def run_tokenizer(self, fn, *args):
        """``fn(*args)`` in a tokenizer thread (tokenizing, chat templates)."""
        return await asyncio.get_running_loop().run_in_executor(self._tok_executor, fn, *args)

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate over its outputs (raises before the first yield when
        the request is refused).

        Raises:
            InvalidRequestError: the request cannot be served (HTTP 400).
            EngineDeadError: the engine core is gone (HTTP 500).
        """
        waiter, rid = await self.submit(prompt, params, request_id, lora_name)
        async for out in self.iterate(rid, waiter):
            yield out

    async def submit(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, lora_name: str | None = None) -> tuple[_Waiter, str]:
        """Tokenize, validate, send and wait for the core's acceptance (computed by the LoRA
        adapter ``lora_name`` when given).

        Raises:
            InvalidRequestError, EngineDeadError: as :meth:`generate`.
        """
        if self.errored is not None:
            raise EngineDeadError(f"the engine core is gone: {self.errored}")
        rid = request_id or self.new_request_id()
        if rid in self._waiters:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        arrival = time.monotonic()
        text, ids, seqs = await self.run_tokenizer(self.input.process, rid, prompt, params, arrival, lora_name)
        if self.errored is not None:
            raise EngineDeadError(f"the engine core is gone: {self.errored}")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(asyncio.Queue(), loop.create_future(), len(seqs))
        self._waiters[rid] = waiter
        for s in seqs:
            self._seq_waiter[s.request_id] = rid
        self.output.add_request(rid, text, ids, params, arrival)
        try:
            await self.client.send(m.AddRequests(seqs))
            await waiter.accepted
        except BaseException:
            await self.abort(rid)
            raise
        return waiter, rid

    async def iterate(self, rid: str, waiter: _Waiter) -> AsyncIterator[RequestOutput]:
        """The outputs of an accepted request; closing early aborts it."""
        finished = False
        try:
            while True:
                item = await waiter.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        """Abort a request now: its sequences leave the core before its next step."""
        self._waiters.pop(request_id, None)
        live = self.output.abort_request(request_id)
        for cid in live:
            self._seq_waiter.pop(cid, None)
        if live and self.errored is None:
            try:
                await self.client.send(m.AbortRequests(live, "abort"))
            except Exception:  # noqa: BLE001  (the core is going away: nothing to free)
                log.debug("abort not sent", exc_info=True)

    # -- background tasks ------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            msg = await self.client.recv()
            self._apply_lora(msg)
            self._apply_admissions(msg)
            if not msg.outputs:
                continue
            results, to_abort = self.output.process_outputs(msg.outputs)
            for out in results:
                w = self._waiters.get(out.request_id)
                if w is not None:
                    w.queue.put_nowait(out)
                    if out.finished:
                        self._waiters.pop(out.request_id, None)
            if to_abort:
                await self.client.send(m.AbortRequests(to_abort, "stop"))

    def _apply_lora(self, msg: m.CoreOutputs) -> None:
        if msg.lora_adapters is not None:
            self.lora_adapters = list(msg.lora_adapters)
        if msg.lora_reply is not None:
            fut = self._lora_waiters.pop(msg.lora_reply.token, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.lora_reply)

    async def lora_control(self, op: str, name: str, path: str = "", timeout: float = 600.0) -> m.LoRAReply:
        """Load (``op`` "load") or unload ("unload") a LoRA adapter in the core and wait for
        its answer (the core reads the adapter between two steps).

        Raises:
            EngineDeadError: the core is gone; TimeoutError: no answer in ``timeout`` seconds.
        """
        if self.errored is not None:
            raise EngineDeadError(f"the engine core is gone: {self.errored}")
        token = next(self._lora_tokens)
        fut = asyncio.get_running_loop().create_future()
        self._lora_waiters[token] = fut
        try:
            await self.client.send(m.LoRAControl(token, op, name, path))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._lora_waiters.pop(token, None)

    def _apply_admissions(self, msg: m.CoreOutputs) -> None:
        for sid in msg.accepted:
            rid = self._seq_waiter.pop(sid, None)
            w = self._waiters.get(rid) if rid is not None else None
            if w is not None:
                w.num_pending -= 1
                if w.num_pending == 0 and not w.accepted.done():
                    if w.rejected:
                        w.accepted.set_exception(InvalidRequestError(w.rejected[0]))
                    else:
                        w.accepted.set_result(None)
        for rej in msg.rejected:
            rid = self._seq_waiter.pop(rej.request_id, None)
            w = self._waiters.get(rid) if rid is not None else None
            if w is not None:
                w.rejected.append(rej.message)
                w.num_pending -= 1
                if w.num_pending == 0 and not w.accepted.done():
                    if rej.status == 404:  # the adapter was unloaded meanwhile
                        from .http_utils import ModelNotFoundError  # noqa: PLC0415

                        w.accepted.set_exception(ModelNotFoundError(rej.message))
                    else:
                        w.accepted.set_exception(InvalidRequestError(w.rejected[0]))

    async def _watch_core(self) -> None:
        while core_alive(self.info.pid):
            await asyncio.sleep(0.2)
        err = EngineDeadError(f"the engine core process (pid {self.info.pid}) exited")
        log.error("%s; failing %d requests", err, len(self._waiters))
        self.errored = err
        self.ready = False
        self._fail_all(err)
        if self.on_dead is not None:
            self.on_dead()

    def fail_running(self, err: BaseException) -> None:
        """End every running request with ``err`` (its stream gets an error event) and abort
        it in the core: the server is stopping and their time is up."""
        if self._waiters:
            log.warning("%s: ending %d running requests", err, len(self._waiters))
        self._fail_all(err)

    def _fail_all(self, err: BaseException) -> None:
        for w in self._waiters.values():
            if not w.accepted.done():
                w.accepted.set_exception(err)
            w.queue.put_nowait(err)
        for fut in self._lora_waiters.values():
            if not fut.done():
                fut.set_exception(err)
        self._waiters.clear()
        self._seq_waiter.clear()

    def api_stats(self) -> m.ApiStats:
        """This process's counters since the last report, and its resource use."""
        failures, self._failures = dict(self._failures), Counter()
        detok = self.output.detokenize_seconds
        delta, self._detok_reported = detok - self._detok_reported, detok
        cpu = self._proc.cpu_times()
        return m.ApiStats(self.process_label, failures, delta, cpu.user + cpu.system, self._proc.memory_info().rss)

    async def _report_stats(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            if self.errored is not None:
                return
            try:
                await self.client.send(self.api_stats())
            except Exception:  # noqa: BLE001
                log.debug("stats not sent", exc_info=True)

    async def render_metrics(self) -> bytes:
        """The Prometheus text of the whole server (the core holds the registry).

        Raises:
            EngineDeadError: the core is gone; TimeoutError: it did not answer.
        """
        if self.errored is not None:
            raise EngineDeadError(f"the engine core is gone: {self.errored}")
        return await self.client.render_metrics(self.api_stats())

    def model_card(self) -> dict[str, Any]:
        return {"id": self.served_model_name, "max_model_len": self.max_model_len}
