"""Fixtures of the router tests: real `kiln serve` upstreams (the embedded default model,
tests/server/kiln_server.py) and a real `kiln router` (uvicorn, in a thread of the test
process, so a test can look at and change its table on its own event loop)."""

from __future__ import annotations

import asyncio
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from kiln_server import start_server, stop_server  # noqa: E402

from kiln.operator.router.app import build_app  # noqa: E402
from kiln.operator.router.config import RouterConfig  # noqa: E402
from kiln.runtime.demo import free_port  # noqa: E402

from router_testutil import MODEL  # noqa: E402,F401


class RunningRouter:
    """A router served by uvicorn on 127.0.0.1 in a thread; ``call(fn)`` runs ``fn()`` on its
    event loop and returns the result."""

    def __init__(self, config: RouterConfig):
        import uvicorn

        from kiln.operator.router.discovery import ApiClient

        self.port = free_port()
        self.config = replace(config, host="127.0.0.1", port=self.port)
        api = ApiClient.from_kubeconfig(config.kubeconfig) if config.kubeconfig and not config.backends else None
        self.app = build_app(self.config, api)
        self.state = self.app.state.router
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> "RunningRouter":
        self.thread.start()
        import time
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the router did not start")
            time.sleep(0.05)
        return self

    def call(self, fn):
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def upstreams():
    """Two real `kiln serve` replicas of the embedded default, served as ``smollm2``."""
    servers = [start_server("--served-model-name", MODEL, "--max-num-seqs", "16", "--max-model-len", "1024")
               for _ in range(2)]
    yield servers
    for s in servers:
        stop_server(s)


@pytest.fixture
def make_router():
    started: list[RunningRouter] = []

    def make(**kw) -> RunningRouter:
        r = RunningRouter(RouterConfig(**kw)).start()
        started.append(r)
        return r

    yield make
    for r in started:
        r.stop()
