"""Waiting on progress, not on the clock.

A fixed deadline sized on an idle machine fails on a loaded one while the thing waited for is
still advancing (a build Job printing, a pod starting). ``wait_for`` gives up only after
``stall`` seconds in which nothing it observes has changed: the waited-for function's own
answer and, checked every ``check_every`` seconds, a ``progress()`` snapshot (pod phases and
container states, Job counts, engine phases and conditions, the size of pods' log files, a
component's log). Size ``stall`` to the longest quiet time the awaited thing has on an idle
machine; a slow machine then only makes a wait longer.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable


class Stalled(TimeoutError):
    """Nothing observable changed for the stall time."""


def wait_for(what: str, fn: Callable[[], Any], *, stall: float = 60.0, interval: float = 0.5,
             progress: Callable[[], Any] | None = None, check_every: float = 5.0,
             on_change: Callable[[Any], None] | None = None) -> Any:
    """Polls fn every interval seconds until it returns something truthy, and returns that.

    Raises Stalled (a TimeoutError) naming what and fn's last answer once neither that answer
    nor progress() has changed for stall seconds. on_change(snapshot) is called with each new
    progress snapshot (to print it)."""
    t0 = last_change = time.monotonic()
    last_value: Any = object()
    last_seen: Any = object()
    next_check = t0
    while True:
        value = fn()
        if value:
            return value
        now = time.monotonic()
        if value != last_value:
            last_value, last_change = value, now
        if progress is not None and now >= next_check:
            seen = progress()
            if seen != last_seen:
                if on_change is not None:
                    on_change(seen)
                last_seen, last_change = seen, time.monotonic()
            next_check = time.monotonic() + check_every
        if time.monotonic() - last_change > stall:
            raise Stalled(f"gave up waiting for {what}: nothing changed for {stall:.0f} s "
                          f"({time.monotonic() - t0:.0f} s in all; last: {last_value!r})")
        time.sleep(interval)


def log_sizes(folder: str | Path, pattern: str = "**/*.log") -> tuple[tuple[str, int], ...]:
    """(path, size) of the log files under folder: grows while processes print."""
    out = []
    for p in sorted(Path(folder).glob(pattern)):
        try:
            out.append((str(p), p.stat().st_size))
        except OSError:
            pass
    return tuple(out)


# An HTTP access-log line (uvicorn's `... "GET /ready HTTP/1.1" 200`): a probe, not progress.
ACCESS_LINE = re.compile(rb'"(GET|POST|PUT|DELETE|HEAD) [^"]* HTTP/[0-9.]+"')


def log_lines(folder: str | Path, pattern: str = "**/*.log", ignore: re.Pattern[bytes] | None = ACCESS_LINE
              ) -> tuple[tuple[str, int], ...]:
    """(path, number of lines) of the log files under folder, not counting lines that match
    ignore (by default HTTP access lines: a server answering its probes is not advancing)."""
    out = []
    for p in sorted(Path(folder).glob(pattern)):
        try:
            data = p.read_bytes()
        except OSError:
            continue
        lines = data.splitlines()
        out.append((str(p), len(lines) if ignore is None else sum(1 for x in lines if not ignore.search(x))))
    return tuple(out)


def objects_state(items: list[dict]) -> tuple:
    """What changes when Kubernetes objects make progress, ignoring heartbeats and timestamps:
    per pod its phase, conditions and container states (with restart counts); per Job its
    active/succeeded/failed counts; per Deployment its replica counts; per InferenceEngine its
    phase, build state, conditions and replicas; per HPA its desired replicas."""
    out = []
    for o in items:
        kind, meta, st = o.get("kind", ""), o.get("metadata") or {}, o.get("status") or {}
        key = (kind, meta.get("namespace", ""), meta.get("name", ""), bool(meta.get("deletionTimestamp")))
        if kind == "Pod":
            conds = tuple((c.get("type"), c.get("status")) for c in st.get("conditions") or [])
            states = tuple((c.get("name"), c.get("restartCount"), json.dumps(
                {k: (v or {}).get("reason") or (v or {}).get("exitCode") for k, v in (c.get("state") or {}).items()},
                sort_keys=True)) for c in st.get("containerStatuses") or [])
            out.append((key, st.get("phase"), conds, states))
        elif kind == "Job":
            out.append((key, st.get("active"), st.get("succeeded"), st.get("failed")))
        elif kind == "InferenceEngine":
            conds = tuple((c.get("type"), c.get("status"), c.get("reason")) for c in st.get("conditions") or [])
            out.append((key, st.get("phase"), (st.get("build") or {}).get("state"), conds,
                        st.get("replicas"), st.get("readyReplicas"), st.get("observedGeneration")))
        elif kind == "HorizontalPodAutoscaler":
            out.append((key, st.get("desiredReplicas"), st.get("currentReplicas")))
        else:
            out.append((key, (o.get("spec") or {}).get("replicas"), st.get("replicas"), st.get("readyReplicas"),
                        st.get("updatedReplicas")))
    return tuple(sorted(out, key=repr))
