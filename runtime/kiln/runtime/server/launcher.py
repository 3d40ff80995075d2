"""``kiln serve``: start the engine core process, then one or more API server processes on
one port (``SO_REUSEPORT``: the kernel spreads connections over them).

With ``--api-server-count 1`` the API server runs in this process; with more, this process
only supervises: SIGTERM/SIGINT go to every API process (each drains its requests for
``--shutdown-timeout``), then the core stops.  When an API process exits on its own the
others are stopped too, and the exit status is non-zero.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import multiprocessing as mp
import signal
import socket
from dataclasses import dataclass

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..config import EngineArgs
from ..engine_core import messages as m
from ..engine_core.client import AsyncCoreClient, CoreAddresses, CoreProcess, CoreStartError
from .serving import ServerLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """The HTTP side of ``kiln serve`` (flags)."""

    host: str
    port: int
    api_key: str | None
    api_server_count: int
    limits: ServerLimits
    protect_metrics: bool
    shutdown_timeout: float
    header_timeout: float
    log_level: str
    tool_call_parser: str = "hermes"


def header_timeout_protocol(seconds: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (the C HTTP parser: a streamed token costs a few
    microseconds less per chunk than with the pure-Python h11), closing a connection whose
    first request's headers have not all arrived ``seconds`` after it opened (a slow-headers
    client holds no slot forever; uvicorn's keep-alive timeout covers idle connections
    between requests)."""

    class _Protocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return _Protocol


def bind_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT (listening unless ``listen`` is False), so
    several API processes share the port.

    Raises:
        ValueError: the address cannot be bound (the message names it).
    """
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use; stop what holds it or pick another --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if listen:
        sock.listen(2048)
    return sock


def run_api_server(info: m.CoreInfo, addresses: CoreAddresses, index: int, opts: ServeOptions,
                   sock: socket.socket | None = None) -> None:
    """One API server process: load the tokenizer, connect to the core, serve HTTP until
    SIGTERM (then drain for ``shutdown_timeout``)."""
    from ..engine_core.loading import load_tokenizer  # noqa: PLC0415
    from ..engine_core.proc import die_with_parent  # noqa: PLC0415
    from .api import build_app  # noqa: PLC0415
    from .async_llm import AsyncLLM  # noqa: PLC0415

    if index > 0 or sock is None:
        die_with_parent()
        logging.basicConfig(level=opts.log_level.upper(),
                            format=f"%(asctime)s %(levelname)s api-{index}: %(message)s")
    sock = sock or bind_socket(opts.host, opts.port)
    tokenizer = load_tokenizer(info.tokenizer)
    if tokenizer is None and index == 0:
        log.warning("the model has no tokenizer files: only token-id prompts are served "
                    "(text prompts, chat, stop strings and structured output get a 400)")
    llm = AsyncLLM(info, AsyncCoreClient(addresses, f"api-{index}"), tokenizer, f"api-{index}")
    app = build_app(llm, api_key=opts.api_key, limits=opts.limits, protect_metrics=opts.protect_metrics,
                    tool_call_parser=opts.tool_call_parser)
    config = uvicorn.Config(app, log_level=opts.log_level.lower(), timeout_graceful_shutdown=opts.shutdown_timeout,
                            http=header_timeout_protocol(opts.header_timeout), access_log=False)
    server = _DrainingServer(config, llm, opts.shutdown_timeout)
    # uvloop: the event loop's per-chunk cost (queue hops, socket writes) is what a streamed
    # token costs in this process beside detokenization
    uvloop.run(server.serve(sockets=[sock]))


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: requests still running shortly before ``--shutdown-timeout``
    ends get an error (a stream's last event says why) instead of a cut connection, and the
    process stops on its own one second after the engine core died (``/health`` fails
    meanwhile), so a server without probes does not stay up broken."""

    def __init__(self, config, llm, drain_seconds: float):
        super().__init__(config)
        self.llm = llm
        self.drain_seconds = drain_seconds
        llm.on_dead = self._on_core_dead

    def _on_core_dead(self) -> None:
        asyncio.get_running_loop().call_later(1.0, setattr, self, "should_exit", True)

    async def shutdown(self, sockets=None) -> None:
        from ..errors import ServerShuttingDownError  # noqa: PLC0415

        err = ServerShuttingDownError(f"the server is shutting down and this request did not finish within "
                                      f"--shutdown-timeout ({self.drain_seconds:g} s)")
        margin = min(1.0, self.drain_seconds / 2)
        timer = asyncio.get_running_loop().call_later(self.drain_seconds - margin, self.llm.fail_running, err)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(args: EngineArgs, opts: ServeOptions) -> int:
    """Run ``kiln serve``; returns the exit status.

    Raises:
        ValueError: the port cannot be bound.
        CoreStartError: the engine core failed to start (its one-line reason).
    """
    # Bound (not listening) now, to fail before loading the model; a socket that does not
    # listen receives none of the port's connections.
    sock = bind_socket(opts.host, opts.port, listen=False)
    if not opts.api_key:
        log.warning("serving without an API key: anyone who reaches port %d can use the model "
                    "(--api-key or KILN_API_KEY)", opts.port)
    from ..hub import download_model_args  # noqa: PLC0415

    args = download_model_args(args)  # a Hub model: its snapshot folder, before the core starts
    core = CoreProcess(args, opts.log_level)
    try:
        info = core.start()
        log.info("engine core ready in %.1fs (pid %d)", info.startup_seconds, info.pid)
        if opts.api_server_count == 1:
            sock.listen(2048)
            run_api_server(info, core.addresses, 0, opts, sock)
            return 0 if core.is_alive() else 1
        return _supervise(info, core.addresses, opts, sock)
    finally:
        sock.close()
        core.shutdown()


def _supervise(info: m.CoreInfo, addresses: CoreAddresses, opts: ServeOptions, sock: socket.socket) -> int:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_api_server, name=f"kiln-api-{i}", args=(info, addresses, i, opts))
             for i in range(opts.api_server_count)]
    for p in procs:
        p.start()
    sock.close()
    stopping = {"flag": False}

    def _forward(signum, frame):
        stopping["flag"] = True
        for p in procs:
            if p.is_alive():
                p.terminate()

    old = {s: signal.signal(s, _forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        from multiprocessing.connection import wait  # noqa: PLC0415

        wait([p.sentinel for p in procs])  # the first to exit
        if not stopping["flag"]:
            log.error("an API server process exited; stopping the others")
            _forward(None, None)
        for p in procs:
            p.join(opts.shutdown_timeout + 5)
            if p.is_alive():
                p.kill()
                p.join(5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    # uvicorn ends a process it stopped on SIGTERM/SIGINT by re-raising that signal
    clean = (0, -signal.SIGTERM, -signal.SIGINT)
    return 0 if stopping["flag"] and all(p.exitcode in clean for p in procs) else 1


__all__ = ["CoreStartError", "ServeOptions", "bind_socket", "run_api_server", "serve"]
