"""Replica discovery: list + watch InferenceEngines and EndpointSlices through the Kubernetes
API and keep the ``ModelTable`` current.

``ApiClient`` is a small async JSON client (httpx) with the credentials of a
``kubernetes.client.Configuration`` (in-cluster ServiceAccount token, re-read on every
connection so a rotated projected token is picked up, or a kubeconfig). ``Discovery`` runs one
reflector per (kind, namespace): list, then watch from the list's ``resourceVersion`` with
bookmarks; a watch that ends is resumed from the last version seen, a ``410 Gone`` (version too
old) or any error relists after a short backoff. Only EndpointSlices of engine Services count,
and of those only ready, non-terminating endpoints (``table.slice_replicas``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import Any, AsyncIterator, Callable, Mapping

import httpx

from .. import constants as c
from ..kube import KubeConfig, load_configuration
from .table import ModelTable

log = logging.getLogger("kiln.router")

ENGINES = f"/apis/{c.GROUP}/{c.VERSION}"  # + [/namespaces/NS]/inferenceengines
SLICES = "/apis/discovery.k8s.io/v1"  # + [/namespaces/NS]/endpointslices


class ApiError(Exception):
    """A non-2xx answer of the API server (``status``: the HTTP code)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class ApiClient:
    """Async JSON access to the API server with a ``kubernetes`` client configuration."""

    def __init__(self, configuration: Any):
        self.conf = configuration
        verify: Any = bool(configuration.verify_ssl)
        if configuration.verify_ssl:
            ctx = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
            if configuration.cert_file:
                ctx.load_cert_chain(configuration.cert_file, configuration.key_file)
            verify = ctx
        self.http = httpx.AsyncClient(base_url=configuration.host, verify=verify,
                                      timeout=httpx.Timeout(30.0, read=None))

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None, context: str | None = None) -> "ApiClient":
        """In-cluster config, else ``kubeconfig`` / ``$KUBECONFIG``.  Raises
        ``kubernetes.config.ConfigException`` when nothing is configured."""
        return cls(load_configuration(KubeConfig(kubeconfig=kubeconfig, context=context)))

    def _headers(self, content_type: str = "application/json") -> dict[str, str]:
        h = {"Accept": "application/json", "Content-Type": content_type}
        auth = self.conf.get_api_key_with_prefix("BearerToken", alias="authorization")
        if auth:
            h["Authorization"] = auth if " " in auth else f"Bearer {auth}"
        return h

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict:
        r = await self.http.get(path, params=dict(params or {}), headers=self._headers(), timeout=30.0)
        if r.status_code >= 300:
            raise ApiError(r.status_code, r.text[:300])
        return r.json()

    async def merge_patch(self, path: str, body: Mapping[str, Any], field_manager: str) -> dict:
        r = await self.http.patch(path, content=json.dumps(body), params={"fieldManager": field_manager},
                                  headers=self._headers("application/merge-patch+json"), timeout=30.0)
        if r.status_code >= 300:
            raise ApiError(r.status_code, r.text[:300])
        return r.json()

    async def watch(self, path: str, resource_version: str) -> AsyncIterator[dict]:
        """The events of a watch from ``resource_version`` (``{"type", "object"}``), until the
        server ends it.  Raises ``ApiError`` (410: the version is too old)."""
        params = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": "300"}
        async with self.http.stream("GET", path, params=params, headers=self._headers(),
                                    timeout=httpx.Timeout(30.0, read=330.0)) as r:
            if r.status_code >= 300:
                raise ApiError(r.status_code, (await r.aread()).decode(errors="replace")[:300])
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def aclose(self) -> None:
        await self.http.aclose()


Handler = Callable[[str, dict], None]  # (event type, object)


async def reflect(api: ApiClient, path: str, on_list: Callable[[list[dict]], None], on_event: Handler,
                  synced: asyncio.Event | None = None, backoff: float = 1.0) -> None:
    """List ``path`` into ``on_list`` and feed watch events to ``on_event``, forever (until
    cancelled).  ``synced`` is set after the first successful list."""
    while True:
        try:
            listing = await api.get(path)
            on_list(listing.get("items") or [])
            if synced is not None:
                synced.set()
            rv = (listing.get("metadata") or {}).get("resourceVersion", "")
            while True:
                gone = False
                async for ev in api.watch(path, rv):
                    kind, obj = ev.get("type"), ev.get("object") or {}
                    if kind == "ERROR":
                        gone = int(obj.get("code") or 0) == 410
                        log.info("watch of %s: %s", path, obj.get("message"))
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                    if kind != "BOOKMARK":
                        on_event(kind, obj)
                if gone:
                    break  # relist
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an API hiccup: relist after a pause
            log.warning("watch of %s failed (%s); listing again", path, e)
            await asyncio.sleep(backoff)


class Discovery:
    """Keeps ``table`` current from the API server for ``namespaces`` (empty: all)."""

    def __init__(self, api: ApiClient, table: ModelTable, namespaces: tuple[str, ...] = ()):
        self.api, self.table, self.namespaces = api, table, namespaces
        self._tasks: list[asyncio.Task] = []
        self._synced: list[asyncio.Event] = []

    def _paths(self, base: str, plural: str) -> list[tuple[str | None, str]]:
        if not self.namespaces:
            return [(None, f"{base}/{plural}")]
        return [(ns, f"{base}/namespaces/{ns}/{plural}") for ns in self.namespaces]

    def start(self) -> None:
        """Start the reflectors (on the running loop)."""
        for ns, path in self._paths(ENGINES, c.PLURAL):
            self._spawn(path, lambda items, ns=ns: self.table.reset(engines=items, namespace=ns), self._engine_event)
        for ns, path in self._paths(SLICES, "endpointslices"):
            self._spawn(path, lambda items, ns=ns: self.table.reset(slices=items, namespace=ns), self._slice_event)

    def _spawn(self, path: str, on_list: Callable[[list[dict]], None], on_event: Handler) -> None:
        ev = asyncio.Event()
        self._synced.append(ev)
        self._tasks.append(asyncio.create_task(reflect(self.api, path, on_list, on_event, ev), name=f"watch {path}"))

    def _engine_event(self, kind: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        if kind == "DELETED":
            self.table.drop_engine(meta.get("namespace", ""), meta.get("name", ""))
        else:
            self.table.set_engine(obj)

    def _slice_event(self, kind: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        if kind == "DELETED":
            self.table.drop_slice(meta.get("namespace", ""), meta.get("name", ""))
        else:
            self.table.set_slice(obj)

    async def wait_synced(self) -> None:
        """Return once every reflector has listed once."""
        for ev in self._synced:
            await ev.wait()
        self.table.synced = True

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

