"""The router's view of what it can route to: engines, the model names each serves, and the
ready replicas of each.  Fed by discovery (InferenceEngines and their Services' EndpointSlices)
or by fixed ``--backend`` upstreams; read by the proxy.

Pure bookkeeping on the event loop (no locks): ``set_engine`` / ``drop_engine`` /
``set_slice`` / ``drop_slice`` change it, ``lookup`` / ``ready`` / ``models`` read it, and
``wait_ready`` lets a held request sleep until its engine has a ready replica.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .. import builders as b
from ..spec import EngineSpecError, parse_spec

log = logging.getLogger("kiln.router")


@dataclass(frozen=True)
class Engine:
    """One routable engine.

    Fields:
        namespace / name: the InferenceEngine ("" namespace: a fixed ``--backend``).
        service: its Service's name (the EndpointSlices' ``kubernetes.io/service-name``).
        models: the model names it serves: the served model name, then its adapters.
        scales_to_zero: ``autoscaling.minReplicas: 0`` (the router writes its activity).
        created: ``metadata.creationTimestamp`` (the older engine wins a name both serve).
    """

    namespace: str
    name: str
    service: str
    models: tuple[str, ...]
    scales_to_zero: bool = False
    created: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def engine_of(body: Mapping[str, Any]) -> Engine | None:
    """The ``Engine`` of an InferenceEngine object, None when its spec does not parse (the
    operator reports it) or it is being deleted or suspended."""
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    try:
        spec = parse_spec(body.get("spec") or {})
    except EngineSpecError:
        return None
    if spec.suspend:
        return None
    owner = {"name": meta["name"], "namespace": meta["namespace"]}
    served = spec.model.served_model_name or meta["name"]
    return Engine(meta["namespace"], meta["name"], b.deployment_name(owner),
                  (served, *(a.name for a in spec.adapters)), spec.autoscaling.scales_to_zero,
                  str(meta.get("creationTimestamp") or ""))


def slice_replicas(body: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """``(service name, base URLs of its ready endpoints)`` of an EndpointSlice: endpoints with
    ``conditions.ready`` true and not terminating, on the slice's first TCP port."""
    meta = body.get("metadata") or {}
    service = (meta.get("labels") or {}).get("kubernetes.io/service-name", "")
    ports = [p for p in body.get("ports") or [] if (p.get("protocol") or "TCP") == "TCP" and p.get("port")]
    if not ports:
        return service, ()
    port = int(ports[0]["port"])
    v6 = body.get("addressType") == "IPv6"
    urls = []
    for ep in body.get("endpoints") or []:
        cond = ep.get("conditions") or {}
        if cond.get("ready") is False or cond.get("terminating") is True:
            continue
        for addr in ep.get("addresses") or []:
            urls.append(f"http://[{addr}]:{port}" if v6 else f"http://{addr}:{port}")
    return service, tuple(sorted(urls))


class ModelTable:
    """Engines, model names and ready replicas (see the module docstring)."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}  # engine key -> Engine
        self._by_model: dict[str, Engine] = {}
        self._slices: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}  # (ns, slice) -> (service, urls)
        self._fixed: dict[str, tuple[str, ...]] = {}  # engine key -> fixed upstream URLs
        self._changed = asyncio.Event()
        self.synced = False  # discovery has listed everything once

    # --- changes -----------------------------------------------------------------------------
    def set_fixed(self, model: str, urls: Iterable[str]) -> None:
        """A fixed upstream model (``--backend``)."""
        eng = Engine("", model, model, (model,))
        self.engines[eng.key] = eng
        self._fixed[eng.key] = tuple(urls)
        self._reindex()

    def set_engine(self, body: Mapping[str, Any]) -> None:
        """An InferenceEngine was added or changed (one that cannot be routed to is dropped)."""
        meta = body.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        eng = engine_of(body)
        if eng is None:
            self.engines.pop(key, None)
        else:
            self.engines[key] = eng
        self._reindex()

    def drop_engine(self, namespace: str, name: str) -> None:
        self.engines.pop(f"{namespace}/{name}", None)
        self._reindex()

    def set_slice(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        self._slices[(meta.get("namespace", ""), meta.get("name", ""))] = slice_replicas(body)
        self._notify()

    def drop_slice(self, namespace: str, name: str) -> None:
        self._slices.pop((namespace, name), None)
        self._notify()

    def reset(self, engines: Iterable[Mapping[str, Any]] | None = None,
              slices: Iterable[Mapping[str, Any]] | None = None, namespace: str | None = None) -> None:
        """Replace the engines and/or the slices of ``namespace`` (None: all) with a fresh
        listing (after a watch restarts)."""
        if engines is not None:
            self.engines = {k: e for k, e in self.engines.items()
                            if namespace is not None and e.namespace != namespace}
            for body in engines:
                eng = engine_of(body)
                if eng is not None:
                    self.engines[eng.key] = eng
            self._reindex()
        if slices is not None:
            self._slices = {k: v for k, v in self._slices.items() if namespace is not None and k[0] != namespace}
            for body in slices:
                meta = body.get("metadata") or {}
                self._slices[(meta.get("namespace", ""), meta.get("name", ""))] = slice_replicas(body)
            self._notify()

    def _reindex(self) -> None:
        by_model: dict[str, Engine] = {}
        for eng in sorted(self.engines.values(), key=lambda e: (e.created, e.key)):
            for m in eng.models:
                if m in by_model and by_model[m].key != eng.key:
                    log.warning("model %r is served by %s and %s: routing to %s (the older)",
                                m, by_model[m].key, eng.key, by_model[m].key)
                    continue
                by_model[m] = eng
        self._by_model = by_model
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- reads -------------------------------------------------------------------------------
    def lookup(self, model: str) -> Engine | None:
        """The engine serving ``model``, or None."""
        return self._by_model.get(model)

    def ready(self, engine: Engine) -> tuple[str, ...]:
        """Base URLs of the engine's ready replicas (sorted)."""
        if engine.key in self._fixed:
            return self._fixed[engine.key]
        urls: set[str] = set()
        for (ns, _), (service, eps) in self._slices.items():
            if ns == engine.namespace and service == engine.service:
                urls.update(eps)
        return tuple(sorted(urls))

    def models(self) -> list[tuple[str, Engine]]:
        """Every model name with its engine, sorted by name."""
        return sorted(self._by_model.items())

    async def wait_ready(self, engine: Engine, timeout: float) -> tuple[str, ...]:
        """The engine's ready replicas once it has any (at once when it does).  Raises
        ``TimeoutError`` after ``timeout`` seconds, ``LookupError`` when the engine goes away
        (deleted, suspended, its model renamed) meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            current = self.engines.get(engine.key)
            if current is None or not set(engine.models) & set(current.models):
                raise LookupError(f"engine {engine.key} is gone")
            urls = self.ready(current)
            if urls:
                return urls
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                raise TimeoutError from None
