"""Forwarding one request: find the engine of its model, hold it while the engine has no ready
replica (bounded queue, timeout), choose a replica, stream the answer back byte for byte.

Streaming-safe: the upstream response is never buffered (Server-Sent Events pass through as
they come), and a client that goes away closes the upstream connection at once (the engine
then aborts the request and frees its KV blocks), whether it left while held, while waiting for
the first byte or in the middle of a stream.  A replica that refuses the connection (a pod that
just went away; nothing was sent) is retried on another ready one.

Errors are JSON in the OpenAI shape ``{"error": {"message", "type", "code"}}``:
404 ``model_not_found``, 503 ``no_ready_replica`` (hold timeout), 503 ``too_many_held``
(the hold queue is full), 502 ``upstream_unreachable``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any, Mapping

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .activity import ActivitySignal
from .balance import Policy, prefix_key
from .config import RouterConfig
from .metrics import RouterMetrics
from .table import Engine, ModelTable

log = logging.getLogger("kiln.router")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy sets itself.
_DROP_REQUEST = {"host", "connection", "keep-alive", "proxy-authorization", "te", "trailer", "transfer-encoding",
                 "upgrade", "content-length"}
_DROP_RESPONSE = {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}


def error(status: int, code: str, message: str) -> JSONResponse:
    """An OpenAI-shaped error response."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status)


async def _disconnected(receive: Receive) -> None:
    """Return when the client goes away (the request body was read before)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class UpstreamResponse(Response):
    """Streams an upstream ``httpx.Response`` to the client; the client leaving cancels the copy
    and closes the upstream connection.  ``done(completed)`` runs exactly once at the end."""

    def __init__(self, upstream: httpx.Response, done):
        self.upstream, self.done = upstream, done
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [(k.lower(), v) for k, v in upstream.headers.raw
                            if k.decode("latin-1").lower() not in _DROP_RESPONSE]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = False

        async def copy() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        copier = asyncio.ensure_future(copy())
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({copier, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if copier.done():
                copier.result()  # an upstream read error surfaces (the client sees a cut stream)
                completed = True
        except (httpx.HTTPError, OSError) as e:
            log.warning("upstream stream broke: %s", e)
        finally:
            for t in (copier, watcher):
                t.cancel()
            await asyncio.gather(copier, watcher, return_exceptions=True)
            await self.upstream.aclose()
            self.done(completed)


class Proxy:
    """Routes requests to replicas (see the module docstring).

    Args:
        table: engines and their ready replicas.
        policy: replica choice.
        config: hold timeout and queue bound, upstream timeout, prefix length.
        metrics: the router's metrics.
        activity: the scale-to-zero activity signal.
    """

    def __init__(self, table: ModelTable, policy: Policy, config: RouterConfig, metrics: RouterMetrics,
                 activity: ActivitySignal):
        self.table, self.policy, self.config, self.metrics, self.activity = table, policy, config, metrics, activity
        self.load: dict[str, int] = defaultdict(int)  # replica URL -> requests in flight
        self.held: dict[str, int] = defaultdict(int)  # engine key -> requests held
        self.outstanding: dict[str, int] = defaultdict(int)  # engine key -> requests in flight
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=10.0, read=config.upstream_timeout_seconds, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def aclose(self) -> None:
        await self.client.aclose()

    def busy(self) -> list[Engine]:
        """Engines with requests held or in flight."""
        keys = {k for k, v in self.held.items() if v} | {k for k, v in self.outstanding.items() if v}
        return [self.table.engines[k] for k in keys if k in self.table.engines]

    def _labels(self, engine: Engine, model: str) -> tuple[str, str, str]:
        return engine.namespace, engine.name, model

    def _gauges(self, engine: Engine, model: str, held: int = 0, outstanding: int = 0) -> None:
        lab = self._labels(engine, model)
        if held:
            self.metrics.held.labels(*lab).inc(held)
        if outstanding:
            self.metrics.outstanding.labels(*lab).inc(outstanding)
        self.metrics.queue.labels(*lab).inc(held + outstanding)

    async def forward(self, request: Request, model: str, path: str, body: bytes,
                      parsed: Mapping[str, Any] | None) -> Response:
        """Forward ``request`` (its ``body`` already read; ``parsed`` its JSON, for the prefix
        key) for ``model`` to ``path`` on a ready replica of the model's engine."""
        engine = self.table.lookup(model)
        if engine is None:
            return error(404, "model_not_found", f"model {model!r} is not served here; GET /v1/models lists "
                                                  "the models")
        lab = self._labels(engine, model)
        replicas = self.table.ready(engine)
        self.activity.seen(engine, urgent=not replicas)
        if not replicas:
            held = await self._hold(request, engine, model)
            if isinstance(held, Response):
                self.metrics.requests.labels(*lab, str(held.status_code)).inc()
                return held
            replicas = held
        key = prefix_key(parsed or {}, self.config.prefix_chars) if self.config.policy == "prefix" else ""
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST]
        tried: set[str] = set()
        while True:
            left = [r for r in replicas if r not in tried]
            if not left:
                self.metrics.requests.labels(*lab, "502").inc()
                return error(502, "upstream_unreachable", f"no replica of {engine.key} accepted the connection "
                                                          f"({len(tried)} tried)")
            replica = self.policy.choose(left, self.load, key)
            self.load[replica] += 1
            self.outstanding[engine.key] += 1
            self._gauges(engine, model, outstanding=1)
            finished = False

            def done(completed: bool, replica=replica) -> None:
                nonlocal finished
                if finished:
                    return
                finished = True
                self.load[replica] -= 1
                if self.load[replica] <= 0:
                    del self.load[replica]
                self.outstanding[engine.key] -= 1
                self._gauges(engine, model, outstanding=-1)

            url = replica + path + (f"?{request.url.query}" if request.url.query else "")
            try:
                up = await self._send(request, self.client.build_request(request.method, url, content=body,
                                                                         headers=headers))
                if up is None:  # the client left before the answer's headers (a non-streamed request)
                    done(False)
                    return Response(status_code=499)
            except httpx.ConnectError as e:
                done(False)
                tried.add(replica)
                self.metrics.retries.labels(*lab).inc()
                log.info("replica %s of %s refused the connection (%s); trying another", replica, engine.key, e)
                continue
            except httpx.ReadTimeout:
                done(False)
                self.metrics.requests.labels(*lab, "504").inc()
                return error(504, "upstream_timeout", f"replica {replica} of {engine.key} sent no answer within "
                             f"{self.config.upstream_timeout_seconds:g} s (--upstream-timeout-seconds)")
            except (httpx.HTTPError, OSError) as e:
                done(False)
                self.metrics.requests.labels(*lab, "502").inc()
                return error(502, "upstream_error",
                             f"replica {replica} of {engine.key} failed: {type(e).__name__}{f': {e}' if str(e) else ''}")
            except asyncio.CancelledError:
                done(False)
                raise
            self.metrics.requests.labels(*lab, str(up.status_code)).inc()
            return UpstreamResponse(up, done)

    async def _send(self, request: Request, upstream: httpx.Request) -> httpx.Response | None:
        """Send ``upstream`` and return its response once its headers came (the body streams
        later); None when the client went away first (the upstream connection is closed then,
        so the engine aborts the request)."""
        sending = asyncio.ensure_future(self.client.send(upstream, stream=True))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        left = True
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
            left = not sending.done()
        finally:
            gone.cancel()
            if left:
                sending.cancel()
            await asyncio.gather(gone, *([sending] if left else []), return_exceptions=True)
        if left and not sending.cancelled() and sending.exception() is None:
            await sending.result().aclose()  # it answered just as the client left
        return None if left else sending.result()

    async def _hold(self, request: Request, engine: Engine, model: str) -> tuple[str, ...] | Response:
        """Wait for a ready replica of ``engine``: its URLs, or the error response (queue full,
        timeout, engine gone, client gone)."""
        if self.held[engine.key] >= self.config.max_held_requests:
            return error(503, "too_many_held", f"{self.held[engine.key]} requests already wait for a replica of "
                                               f"{model!r}; try again later")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.held[engine.key] += 1
        self._gauges(engine, model, held=1)
        waiter = asyncio.ensure_future(self.table.wait_ready(engine, self.config.hold_timeout_seconds))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                return Response(status_code=499)  # nobody is listening: nothing is sent upstream
            try:
                return waiter.result()
            except TimeoutError:
                return error(503, "no_ready_replica",
                             f"model {model!r} has no ready replica after {self.config.hold_timeout_seconds:g} s "
                             f"(engine {engine.key} is scaling up or cannot start: kubectl describe ie "
                             f"{engine.name} -n {engine.namespace})")
            except LookupError:
                return error(404, "model_not_found", f"model {model!r} went away while the request waited")
        finally:
            for t in (waiter, gone):
                t.cancel()
            await asyncio.gather(waiter, gone, return_exceptions=True)
            self.held[engine.key] -= 1
            self._gauges(engine, model, held=-1)
            self.metrics.hold_seconds.labels(*self._labels(engine, model)).observe(loop.time() - t0)
