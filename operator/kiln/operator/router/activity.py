"""The router's one write: the scale-to-zero activity signal.

For an engine with ``autoscaling.minReplicas: 0`` the router sets the annotation
``kiln.dev/last-request-time`` (RFC 3339) on its InferenceEngine: at once when it holds a
request because the engine has no ready replica (the operator then scales it 0 -> 1), and at
most every ``activity_seconds`` while requests for it arrive or are in flight (the operator's
idle window, ``kiln.operator.idle``, counts from it).  The operator stays the only writer of the
Deployment: the annotation is a signal it reconciles, like a spec field.  A merge patch of that
one key with field manager ``kiln-router``; a failed write is logged and tried again at the next
request or tick (a lost write only makes the idle window end sooner, never a request fail).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Callable

from .. import constants as c
from .discovery import ENGINES, ApiClient
from .table import Engine

log = logging.getLogger("kiln.router")

FIELD_MANAGER = "kiln-router"
URGENT_MIN_SECONDS = 1.0  # at most one wake-up write per engine per second


def rfc3339_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ActivitySignal:
    """Writes the last-request annotation of engines that scale to zero.

    Args:
        api: the API client (None: no Kubernetes, nothing is written).
        activity_seconds: least time between two regular writes for one engine.
        clock: monotonic seconds.
    """

    def __init__(self, api: ApiClient | None, activity_seconds: float,
                 clock: Callable[[], float] = time.monotonic):
        self.api, self.activity_seconds, self.clock = api, activity_seconds, clock
        self._written: dict[str, float] = {}  # engine key -> monotonic time of the last write
        self._dirty: dict[str, Engine] = {}  # engines with a request since their last write
        self._tasks: set[asyncio.Task] = set()
        self.num_writes = 0
        self.num_failures = 0

    def seen(self, engine: Engine, urgent: bool = False) -> None:
        """A request for ``engine`` arrived (``urgent``: it is held, no replica is ready)."""
        if self.api is None or not engine.scales_to_zero:
            return
        last = self._written.get(engine.key)
        gap = URGENT_MIN_SECONDS if urgent else self.activity_seconds
        if last is None or self.clock() - last >= gap:
            self._write(engine)
        else:
            self._dirty[engine.key] = engine

    def busy(self, engines: list[Engine]) -> None:
        """Engines with requests held or in flight now (called every tick)."""
        for e in engines:
            if e.scales_to_zero:
                self._dirty[e.key] = e

    def tick(self) -> None:
        """Write the engines that saw requests since their last write, once their gap passed."""
        now = self.clock()
        for key, eng in list(self._dirty.items()):
            if now - self._written.get(key, -1e18) >= self.activity_seconds:
                self._write(eng)

    def _write(self, engine: Engine) -> None:
        self._written[engine.key] = self.clock()
        self._dirty.pop(engine.key, None)
        task = asyncio.get_running_loop().create_task(self._patch(engine))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _patch(self, engine: Engine) -> None:
        path = f"{ENGINES}/namespaces/{engine.namespace}/{c.PLURAL}/{engine.name}"
        body = {"metadata": {"annotations": {c.ANNOTATION_LAST_REQUEST: rfc3339_now()}}}
        try:
            await self.api.merge_patch(path, body, FIELD_MANAGER)  # type: ignore[union-attr]
            self.num_writes += 1
        except Exception as e:  # noqa: BLE001
            self.num_failures += 1
            self._written.pop(engine.key, None)  # the next request tries again at once
            self._dirty[engine.key] = engine
            log.warning("could not write the activity of %s: %s", engine.key, e)

    async def run(self, period: float = 1.0, busy: Callable[[], list[Engine]] | None = None) -> None:
        """Tick every ``period`` seconds (until cancelled); ``busy`` lists engines in use."""
        while True:
            await asyncio.sleep(period)
            if busy is not None:
                self.busy(busy())
            self.tick()
