"""Starting the engine core process and talking to it from an API server process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
from dataclasses import dataclass

import msgspec
import psutil
import zmq
import zmq.asyncio

from ..config import EngineArgs
from . import messages as m


class CoreStartError(RuntimeError):
    """The engine core did not start; ``exit_code`` is 2 for bad input, 1 otherwise."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class CoreAddresses:
    """The core's two ZeroMQ endpoints (``ipc://`` paths in a private folder)."""

    input: str
    metrics: str
    folder: str


def new_addresses() -> CoreAddresses:
    folder = tempfile.mkdtemp(prefix="kiln-core-")
    return CoreAddresses(f"ipc://{folder}/core.sock", f"ipc://{folder}/metrics.sock", folder)


class CoreProcess:
    """The engine core's process, started and waited for.

    ``start()`` returns once the model is loaded and warmed up.

    Raises:
        CoreStartError: the core reported a start-up failure or died while starting.
    """

    def __init__(self, args: EngineArgs, log_level: str = "INFO"):
        self.args = args
        self.log_level = log_level
        self.addresses = new_addresses()
        self.info: m.CoreInfo | None = None
        self._proc: mp.process.BaseProcess | None = None

    def start(self) -> m.CoreInfo:
        from .proc import run_engine_core  # noqa: PLC0415

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, name="kiln-engine-core", daemon=False,
                                 args=(self.args, self.addresses.input, self.addresses.metrics, child,
                                       self.log_level))
        self._proc.start()
        child.close()
        while True:
            if parent.poll(0.2):
                try:
                    msg = parent.recv()
                except EOFError:
                    msg = None
                break
            if not self._proc.is_alive():
                msg = parent.recv() if parent.poll(0) else None
                break
        if msg is None:
            self._proc.join(5)
            raise CoreStartError(f"the engine core exited while starting (exit code {self._proc.exitcode})", 1)
        if msg[0] == "error":
            self._proc.join(10)
            raise CoreStartError(msg[1], int(msg[2]))
        self.info = msgspec.msgpack.decode(msg[1], type=m.CoreInfo)
        return self.info

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop (SIGUSR1: it ignores SIGTERM/SIGINT so that a signal to the
        whole process group lets the API processes drain first), then kill it if it has not
        stopped after ``timeout`` seconds."""
        p = self._proc
        if p is None:
            return
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
            p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
        for name in ("core.sock", "metrics.sock"):
            try:
                os.unlink(os.path.join(self.addresses.folder, name))
            except OSError:
                pass
        try:
            os.rmdir(self.addresses.folder)
        except OSError:
            pass


def core_alive(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie counts as dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class AsyncCoreClient:
    """An API process's connection to the core: one DEALER socket (asyncio) for requests and
    outputs, one REQ socket per metrics scrape.

    Args:
        addresses: the core's endpoints.
        identity: this client's name on the core's ROUTER (unique per API process).
    """

    def __init__(self, addresses: CoreAddresses, identity: str):
        self.addresses = addresses
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.linger = 0
        self.sock.connect(addresses.input)

    async def send(self, msg: msgspec.Struct) -> None:
        await self.sock.send(m.encode(msg), copy=False)

    async def recv(self) -> m.CoreOutputs:
        return m.decode_core_outputs(await self.sock.recv())

    async def render_metrics(self, api_stats: m.ApiStats | None, timeout: float = 10.0) -> bytes:
        """The core's Prometheus text (after applying ``api_stats``).

        Raises:
            TimeoutError: the core did not answer within ``timeout`` seconds.
        """
        req = self.ctx.socket(zmq.REQ)
        req.linger = 0
        req.connect(self.addresses.metrics)
        try:
            await req.send(msgspec.msgpack.encode(api_stats) if api_stats is not None else b"")
            if not await req.poll(int(timeout * 1000)):
                raise TimeoutError("the engine core did not answer the metrics request")
            return await req.recv()
        finally:
            req.close()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def wait_until(pred, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``pred()`` until true or ``timeout`` seconds passed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()
