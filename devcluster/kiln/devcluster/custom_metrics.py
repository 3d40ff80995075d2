"""A small custom-metrics API server (custom.metrics.k8s.io/v1beta2) that tests feed by hand.

The plane registers it as an APIService behind an ExternalName Service pointing at 127.0.0.1, so
the aggregator in kube-apiserver proxies the HPA controller's metric reads here. Tests (or, later,
a scraper of real pods' /metrics) feed values through `CustomMetrics.set(...)`, which POSTs to
this same server's /kiln/v1/metrics.

Pods metrics (`.../namespaces/NS/pods/*/METRIC?labelSelector=...`) are answered per pod: the
server lists the pods matching the HPA's selector from the API server and gives each the value of
the most specific entry that matches it: its own name, then a label selector, then "*".

Run: python custom_metrics.py --port P --cert C --key K --apiserver URL --ca CA --client-cert X --client-key Y
Stdlib only, so it runs under any python3.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import ssl
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

GROUP = "custom.metrics.k8s.io"
VERSION = "v1beta2"
FEED_PATH = "/kiln/v1/metrics"

_OBJECT_RE = re.compile(rf"^/apis/{GROUP}/{VERSION}/namespaces/([^/]+)/([^/]+)/([^/]+)/([^/]+)$")


def quantity(value: float) -> str:
    """A Kubernetes quantity string for value, exact to 1/1000 ('1500m')."""
    milli = round(float(value) * 1000)
    return f"{milli // 1000}" if milli % 1000 == 0 else f"{milli}m"


def _resource(name: str) -> str:
    """Normalizes 'Deployment', 'deployments', 'deployments.apps' to 'deployment'."""
    base = name.split(".", 1)[0].lower()
    return base[:-1] if base.endswith("s") else base


def parse_selector(text: str) -> dict[str, str]:
    """'a=b,c==d' -> {'a': 'b', 'c': 'd'} (equality terms only)."""
    out = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        k, _, v = term.replace("==", "=").partition("=")
        out[k.strip()] = v.strip()
    return out


class Store:
    """Fed values: (namespace, metric) -> list of entries; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], list[dict]] = {}

    def put(self, entry: dict) -> None:
        key = (entry["namespace"], entry["metric"])
        with self._lock:
            kept = [e for e in self._entries.get(key, []) if e["target"] != entry["target"]]
            kept.append(entry)
            self._entries[key] = kept

    def clear(self, namespace: str | None) -> None:
        with self._lock:
            for key in [k for k in self._entries if namespace is None or k[0] == namespace]:
                del self._entries[key]

    def entries(self, namespace: str, metric: str) -> list[dict]:
        with self._lock:
            return list(self._entries.get((namespace, metric), []))

    def metric_names(self) -> set[str]:
        with self._lock:
            return {m for (_, m) in self._entries}

    def dump(self) -> list[dict]:
        with self._lock:
            return [e for es in self._entries.values() for e in es]


def pod_value(entries: list[dict], name: str, labels: dict[str, str]) -> float | None:
    """The value for one pod: exact name, then the first matching selector, then '*'."""
    best, rank = None, 99
    for e in entries:
        t = e["target"]
        if t.get("resource", "pod") != "pod":
            continue
        if t.get("name") == name:
            r = 0
        elif "selector" in t and all(labels.get(k) == v for k, v in t["selector"].items()):
            r = 1
        elif t.get("name") == "*":
            r = 2
        else:
            continue
        if r < rank:
            best, rank = e["value"], r
    return best


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, store: Store, kube: dict):
        super().__init__(addr, Handler)
        self.store = store
        self.kube = kube  # apiserver URL and an ssl context holding a client certificate

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        q = urllib.parse.urlencode({"labelSelector": label_selector}) if label_selector else ""
        url = f"{self.kube['url']}/api/v1/namespaces/{namespace}/pods?{q}"
        with urllib.request.urlopen(url, context=self.kube["ctx"], timeout=10) as r:
            return json.load(r)["items"]


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: one line per request is noise under the HPA's polling
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, msg: str) -> None:
        reason = {404: "NotFound", 400: "BadRequest"}.get(code, "InternalError")
        self._send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                          "message": msg, "reason": reason, "code": code})

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        url = urllib.parse.urlsplit(self.path)
        path, query = url.path.rstrip("/"), urllib.parse.parse_qs(url.query)
        gv = f"{GROUP}/{VERSION}"
        if path == "/apis":
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [self._group()]})
        if path == f"/apis/{GROUP}":
            return self._send(200, {"kind": "APIGroup", "apiVersion": "v1", **self._group()})
        if path == f"/apis/{gv}":
            res = [{"name": f"pods/{m}", "singularName": "", "namespaced": True, "kind": "MetricValueList",
                    "verbs": ["get"]} for m in sorted(self.server.store.metric_names())]
            return self._send(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                                    "resources": res})
        if path == "/openapi/v2":  # the aggregator merges every APIService's spec; this one has no paths
            return self._send(200, {"swagger": "2.0", "info": {"title": "kiln custom metrics", "version": VERSION},
                                    "paths": {}})
        if path == "/openapi/v3":
            return self._send(200, {"paths": {}})
        if path in ("/healthz", "/readyz", "/livez"):
            return self._send(200, {"status": "ok"})
        if path == FEED_PATH:
            return self._send(200, {"items": self.server.store.dump()})
        m = _OBJECT_RE.match(path)
        if not m:
            return self._status(404, f"no such path {path}")
        ns, resource, name, metric = (urllib.parse.unquote(g) for g in m.groups())
        try:
            items = self._items(ns, _resource(resource), name, metric, query.get("labelSelector", [""])[0])
        except Exception as exc:  # an API server error becomes a 500 the HPA reports
            return self._status(500, f"listing pods: {exc}")
        if not items:
            return self._status(404, f"no value fed for {resource}/{name} metric {metric} in {ns}")
        self._send(200, {"kind": "MetricValueList", "apiVersion": gv, "metadata": {}, "items": items})

    def _group(self) -> dict:
        gv = {"groupVersion": f"{GROUP}/{VERSION}", "version": VERSION}
        return {"name": GROUP, "versions": [gv], "preferredVersion": gv}

    def _items(self, ns: str, resource: str, name: str, metric: str, selector: str) -> list[dict]:
        entries = self.server.store.entries(ns, metric)
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

        def item(kind: str, api_version: str, obj_name: str, value: float) -> dict:
            return {"describedObject": {"kind": kind, "namespace": ns, "name": obj_name, "apiVersion": api_version},
                    "metric": {"name": metric}, "timestamp": now, "windowSeconds": 30, "value": quantity(value)}

        if resource == "pod":
            if not entries:
                return []
            out = []
            for pod in self.server.list_pods(ns, selector):
                meta = pod["metadata"]
                if meta.get("deletionTimestamp") or (name != "*" and meta["name"] != name):
                    continue
                v = pod_value(entries, meta["name"], meta.get("labels") or {})
                if v is not None:
                    out.append(item("Pod", "/v1", meta["name"], v))
            return out
        return [item(resource.capitalize(), "", e["target"]["name"], e["value"]) for e in entries
                if e["target"].get("resource") == resource and e["target"].get("name") in (name, "*")]

    def do_POST(self) -> None:  # noqa: N802
        if urllib.parse.urlsplit(self.path).path != FEED_PATH:
            return self._status(404, "POST only to " + FEED_PATH)
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            entry = {"namespace": str(body["namespace"]), "metric": str(body["metric"]),
                     "target": dict(body["target"]), "value": float(body["value"])}
        except (KeyError, TypeError, ValueError) as exc:
            return self._status(400, f"bad feed: {exc}")
        self.server.store.put(entry)
        self._send(200, entry)

    def do_DELETE(self) -> None:  # noqa: N802
        url = urllib.parse.urlsplit(self.path)
        if url.path != FEED_PATH:
            return self._status(404, "DELETE only to " + FEED_PATH)
        ns = urllib.parse.parse_qs(url.query).get("namespace", [None])[0]
        self.server.store.clear(ns)
        self._send(200, {"cleared": ns or "*"})


def target_of(target) -> dict:
    """Normalizes a feed target: 'name' or 'pod/name' (one pod), '*' (every pod of the namespace),
    {'app': 'x'} or 'app=x' (pods by labels), 'deployment/name' (an object metric)."""
    if isinstance(target, dict):
        return {"resource": "pod", "selector": {str(k): str(v) for k, v in target.items()}}
    text = str(target)
    if "=" in text:
        return {"resource": "pod", "selector": parse_selector(text)}
    if "/" in text:
        res, _, name = text.partition("/")
        return {"resource": _resource(res), "name": name}
    return {"resource": "pod", "name": text}


class CustomMetrics:
    """Client of the feed API: `plane.custom_metrics.set("ns", {"app": "x"}, "kiln_queue", 2.5)`."""

    def __init__(self, url: str, ca_file: str):
        self.url = url.rstrip("/")
        self._ctx = ssl.create_default_context(cafile=ca_file)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=self._ctx, timeout=10) as r:
            return json.load(r)

    def set(self, namespace: str, target, metric: str, value: float) -> None:
        """Feeds metric=value for target (see target_of) in namespace; replaces the earlier value."""
        self._call("POST", FEED_PATH, {"namespace": namespace, "target": target_of(target),
                                       "metric": metric, "value": float(value)})

    def clear(self, namespace: str | None = None) -> None:
        """Forgets every fed value (of one namespace, or of all)."""
        q = "?" + urllib.parse.urlencode({"namespace": namespace}) if namespace else ""
        self._call("DELETE", FEED_PATH + q)

    def values(self) -> list[dict]:
        return self._call("GET", FEED_PATH)["items"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--apiserver", required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--client-cert", required=True)
    p.add_argument("--client-key", required=True)
    a = p.parse_args()
    kctx = ssl.create_default_context(cafile=a.ca)
    kctx.load_cert_chain(a.client_cert, a.client_key)
    srv = Server(("127.0.0.1", a.port), Store(), {"url": a.apiserver.rstrip("/"), "ctx": kctx})
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(a.cert, a.key)
    srv.socket = sctx.wrap_socket(srv.socket, server_side=True)
    print(f"custom metrics API on https://127.0.0.1:{a.port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
