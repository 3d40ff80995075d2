"""The controller loop around the reconciler: a de-duplicating work queue (a key is never
reconciled by two workers at once; events that arrive mid-reconcile requeue it once), retry
with exponential backoff, a periodic resync of every known engine (drift repair, level-based),
and the builtin autoscaler's scrape loop.

Runs inside kopf's event loop; reconciles run in worker threads (the API client is blocking).
kopf only feeds it watch events (``observe_engine``, ``observe_child``): no kopf state is
stored on the resources (no progress or diff-base annotations, no finalizers).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Mapping

from . import builders as b
from . import constants as c
from .autoscaler import BuiltinAutoscaler
from .conditions import now_rfc3339
from .enginegc import EngineJanitor, GcSettings
from .kube import ApiError, Kube
from .reconcile import Reconciler, ReconcilerConfig
from .spec import AutoscalingSpec, EngineSpecError, parse_spec

log = logging.getLogger(__name__)


@dataclass
class ControllerConfig:
    """Loop settings (seconds / counts).

    Fields:
        workers: concurrent reconciles (threads).
        resync_seconds: every known engine is reconciled at least this often.
        autoscale_seconds: builtin autoscaler scrape interval.
        backoff_base / backoff_max: retry delays after a failed reconcile.
        engine_gc_seconds: the engine cache cleanup step runs this often (0: never).
        router_namespace / router_selector: where the Kiln router's pods are (namespace and
            label selector), whose ``/metrics`` the builtin autoscaler reads for
            ``autoscaling.metric: routerQueue`` (empty selector: no router; such an engine
            keeps its replicas).
    """

    workers: int = 8
    resync_seconds: float = 60.0
    autoscale_seconds: float = 15.0
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    engine_gc_seconds: float = 300.0
    router_namespace: str = ""
    router_selector: str = ""


def _rv(body: Mapping[str, Any] | None) -> int:
    try:
        return int((body or {}).get("metadata", {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


class Controller:
    """Owns the queue, the engine cache (last seen bodies) and the loops."""

    def __init__(self, kube: Kube, reconciler_config: ReconcilerConfig | None = None,
                 config: ControllerConfig | None = None, autoscaler: BuiltinAutoscaler | None = None,
                 gc: GcSettings | None = None):
        self.kube = kube
        self.janitor = EngineJanitor(kube, gc or GcSettings(image=(reconciler_config or ReconcilerConfig()).default_image))
        self.config = config or ControllerConfig()
        self.autoscaler = autoscaler or BuiltinAutoscaler()
        self.reconciler = Reconciler(kube, reconciler_config, scaler=self.autoscaler.wish, peers=self.engines_in)
        self.bodies: dict[str, dict] = {}  # key -> last seen InferenceEngine
        self.failures: dict[str, int] = {}
        self.num_reconciles = 0
        self.num_errors = 0  # reconciles that raised (retried with backoff)
        self.reconcile_seconds = 0.0  # total time spent in reconciles
        self.heartbeat: float | None = None  # monotonic time of the loop's last beat (None: not started)
        self._queue: asyncio.Queue[str] | None = None
        self._queued: set[str] = set()
        self._active: set[str] = set()
        self._dirty: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- inputs from kopf ----------------------------------------------------------------------
    def observe_engine(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """An InferenceEngine watch event (``None`` type: the initial listing)."""
        key = f"{body['metadata']['namespace']}/{body['metadata']['name']}"
        if event_type == "DELETED":
            self.bodies.pop(key, None)
            self.failures.pop(key, None)
            self.autoscaler.forget(key)
            self.reconciler.forget(body["metadata"].get("uid", ""))
            return
        if _rv(body) >= _rv(self.bodies.get(key)):
            self.bodies[key] = _plain(body)
        self.enqueue(key)

    def observe_child(self, body: Mapping[str, Any]) -> None:
        """A child's watch event: reconcile its InferenceEngines (every owner of a shared
        build Job)."""
        meta = body.get("metadata") or {}
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") == c.KIND and ref.get("apiVersion", "").startswith(c.GROUP + "/"):
                self.enqueue(f"{meta.get('namespace')}/{ref.get('name')}")

    def observe_pod(self, body: Mapping[str, Any]) -> None:
        """A Kiln pod's watch event: reconcile the InferenceEngines it serves or builds for (a
        crash, a failed start or an unschedulable pod changes their status).  Serving pods carry
        their resource's label; build pods the engine hash, shared by every resource needing it."""
        meta = body.get("metadata") or {}
        labels, ns = meta.get("labels") or {}, meta.get("namespace")
        if labels.get(c.LABEL_COMPONENT) == c.COMPONENT_SERVER:
            engine = labels.get(c.LABEL_ENGINE)
            for key, eng in list(self.bodies.items()):
                m = eng["metadata"]
                if m.get("namespace") == ns and b.label_value(m.get("name", "")) == engine:
                    self.enqueue(key)
        elif labels.get(c.LABEL_COMPONENT) == c.COMPONENT_BUILD:
            h = labels.get(c.LABEL_ENGINE_HASH)
            for key, eng in list(self.bodies.items()):
                st = eng.get("status") or {}
                draft = ((st.get("engine") or {}).get("draft") or {}).get("hash")  # a draft engine's build
                if eng["metadata"].get("namespace") == ns and h in (st.get("engineHash"), draft):
                    self.enqueue(key)

    def engines_in(self, namespace: str) -> list[dict]:
        """The InferenceEngines of ``namespace`` as last seen (the reconciler's peers)."""
        return [body for body in list(self.bodies.values()) if body["metadata"].get("namespace") == namespace]

    # --- queue ---------------------------------------------------------------------------------
    def enqueue(self, key: str) -> None:
        """Queue ``key`` unless already queued; if it is being reconciled, once more after."""
        if self._queue is None or key in self._queued:
            return
        if key in self._active:
            self._dirty.add(key)
            return
        self._queued.add(key)
        self._queue.put_nowait(key)

    def _enqueue_later(self, key: str, delay: float) -> None:
        assert self._loop is not None
        self._loop.call_later(delay, self.enqueue, key)

    async def _worker(self) -> None:
        assert self._queue is not None
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            body = self.bodies.get(key)
            if body is None:
                continue
            self._active.add(key)
            t0 = time.monotonic()
            try:
                out = await asyncio.to_thread(self.reconciler.reconcile, body)
                self.num_reconciles += 1
                self.reconcile_seconds += time.monotonic() - t0
                self.failures.pop(key, None)
                if out.requeue_after is not None:
                    self._enqueue_later(key, out.requeue_after + 0.5)
                if out.body is not None and _rv(out.body) > _rv(self.bodies.get(key)) and key in self.bodies:
                    self.bodies[key] = _plain(out.body)
            except Exception as e:  # noqa: BLE001 - logged, retried with backoff
                self.num_errors += 1
                self.reconcile_seconds += time.monotonic() - t0
                n = self.failures[key] = self.failures.get(key, 0) + 1
                delay = min(self.config.backoff_max, self.config.backoff_base * 2 ** (n - 1))
                delay *= 1 + random.random() * 0.1
                level = logging.WARNING if isinstance(e, ApiError) else logging.ERROR
                log.log(level, "reconcile %s failed (%d), retry in %.1fs: %s", key, n, delay, e,
                        exc_info=not isinstance(e, ApiError))
                self._enqueue_later(key, delay)
            finally:
                self._active.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)

    async def _beat(self) -> None:
        while True:
            self.heartbeat = time.monotonic()
            await asyncio.sleep(1.0)

    def alive(self, stale_seconds: float = 30.0) -> bool:
        """The work loop runs: its heartbeat is fresh and no worker or loop task has died."""
        if self.heartbeat is None or time.monotonic() - self.heartbeat > stale_seconds:
            return False
        return not any(t.done() for t in self._tasks)

    def metrics_text(self) -> str:
        """The controller's counters in the Prometheus text format."""
        rows = [
            ("kiln_operator_reconciles_total", "counter", "Reconciles that completed.", self.num_reconciles),
            ("kiln_operator_reconcile_errors_total", "counter", "Reconciles that failed (retried with backoff).",
             self.num_errors),
            ("kiln_operator_reconcile_seconds_total", "counter", "Time spent reconciling.",
             round(self.reconcile_seconds, 6)),
            ("kiln_operator_queue_depth", "gauge", "InferenceEngines waiting for a reconcile.", len(self._queued)),
            ("kiln_operator_reconciles_active", "gauge", "Reconciles running now.", len(self._active)),
            ("kiln_operator_engines", "gauge", "InferenceEngines watched.", len(self.bodies)),
            ("kiln_operator_engines_failing", "gauge", "InferenceEngines whose last reconcile failed.",
             len(self.failures)),
        ]
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(out) + "\n"

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync_seconds)
            for key in list(self.bodies):
                self.enqueue(key)

    async def _autoscale(self) -> None:
        while True:
            await asyncio.sleep(self.config.autoscale_seconds)
            for key, body in list(self.bodies.items()):
                try:
                    spec = parse_spec(body.get("spec") or {})
                except EngineSpecError:
                    spec = None  # the reconcile reports it (InvalidSpec)
                if spec is None or spec.autoscaling.mode != "builtin" or spec.suspend:
                    self.autoscaler.forget(key)
                    continue
                try:
                    changed = await asyncio.to_thread(self._scrape_one, key, body, spec.autoscaling)
                except Exception as e:  # noqa: BLE001
                    log.warning("autoscaler scrape of %s failed: %s", key, e)
                    continue
                if changed:
                    self.enqueue(key)

    def _scrape_one(self, key: str, body: Mapping[str, Any], scaling: AutoscalingSpec) -> bool:
        meta = body["metadata"]
        owner = {"name": meta["name"], "namespace": meta["namespace"]}
        dep = self.kube.get("apps/v1", "Deployment", meta["namespace"], b.deployment_name(owner))
        if dep is None:
            return False
        current = int((dep.get("spec") or {}).get("replicas") or 0)
        if scaling.signal.per_engine:  # the router's queue: scrape the router's pods
            if not self.config.router_selector:
                log.warning("%s: autoscaling.metric %s needs the router (--router-selector); replicas kept",
                            key, scaling.metric)
                return False
            pods = self.kube.list("v1", "Pod", self.config.router_namespace,
                                  label_selector=self.config.router_selector)
        else:
            pods = self.kube.list("v1", "Pod", meta["namespace"], label_selector=b.selector_string(owner))
        ready = [p for p in pods if _pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
        return self.autoscaler.observe(key, ready, current, scaling, now_rfc3339())

    async def _engine_gc(self) -> None:
        while True:
            await asyncio.sleep(self.config.engine_gc_seconds)
            claims: dict[str, set[str]] = {}
            for body in list(self.bodies.values()):
                try:
                    spec = parse_spec(body.get("spec") or {})
                except EngineSpecError:
                    continue
                claims.setdefault(body["metadata"]["namespace"], set()).add(spec.storage.claim_name)
            for ns, names in sorted(claims.items()):
                try:
                    plans = await asyncio.to_thread(self.janitor.run_once, ns, names, now_rfc3339())
                except Exception as e:  # noqa: BLE001 - the next step tries again
                    log.warning("engine cache cleanup in %s failed: %s", ns, e)
                    continue
                for p in plans:  # resources waiting for a cleanup to finish, or whose record changed
                    if p.delete_records or p.delete_jobs:
                        for key, body in list(self.bodies.items()):
                            if body["metadata"]["namespace"] == ns:
                                self.enqueue(key)

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start workers and loops on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        for key in self.bodies:
            self.enqueue(key)
        self._tasks = [asyncio.create_task(self._worker(), name=f"kiln-worker-{i}")
                       for i in range(self.config.workers)]
        self._tasks.append(asyncio.create_task(self._resync(), name="kiln-resync"))
        self._tasks.append(asyncio.create_task(self._beat(), name="kiln-heartbeat"))
        self._tasks.append(asyncio.create_task(self._autoscale(), name="kiln-autoscale"))
        if self.config.engine_gc_seconds > 0:
            self._tasks.append(asyncio.create_task(self._engine_gc(), name="kiln-engine-gc"))

    async def stop(self) -> None:
        """Cancel the loops and wait for them."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def idle(self) -> bool:
        """True when nothing is queued or running (tests and benchmarks wait for this)."""
        return not self._queued and not self._active and not self._dirty


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    for cd in (pod.get("status") or {}).get("conditions") or []:
        if cd.get("type") == "Ready":
            return cd.get("status") == "True"
    return False


def _plain(body: Mapping[str, Any]) -> dict:
    """A plain-dict copy of a kopf body (kopf passes live views)."""
    meta = body.get("metadata") or {}
    out = {k: meta.get(k) for k in ("name", "namespace", "uid", "generation", "resourceVersion",
                                    "deletionTimestamp", "creationTimestamp")}
    # The router's activity annotation (scale to zero, idle.py): the only annotation the plan reads.
    last_request = (meta.get("annotations") or {}).get(c.ANNOTATION_LAST_REQUEST)
    if last_request is not None:
        out["annotations"] = {c.ANNOTATION_LAST_REQUEST: last_request}
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": out,
            "spec": _copy(body.get("spec") or {}), "status": _copy(body.get("status") or {})}


def _copy(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_copy(v) for v in x]
    return x
