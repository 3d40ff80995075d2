"""An in-memory stand-in for ``kiln.operator.kube.Kube``: enough API-server behaviour
(resourceVersion, generation on spec change, status subresource, label selectors,
compare-and-swap on replace) to unit-test the reconciler and the leader elector."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from kiln.operator.kube import ApiError


def _key(api_version: str, kind: str, ns: str | None, name: str) -> tuple:
    return (api_version, kind, ns or "", name)


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple, dict] = {}
        self.rv = itertools.count(1)
        self.calls: list[tuple[str, str, str]] = []  # (verb, kind, name)
        self.logs: dict[tuple[str, str], str] = {}  # (namespace, pod) -> the container's log
        self.served: dict[str, set[str]] = {}  # optional APIs: apiVersion -> kinds (discovery)

    # reads
    def served_kinds(self, api_version):
        self.calls.append(("discover", api_version, ""))
        return frozenset(self.served.get(api_version, ()))

    def get(self, api_version, kind, namespace, name):
        self.calls.append(("get", kind, name))
        o = self.objects.get(_key(api_version, kind, namespace, name))
        return copy.deepcopy(o) if o else None

    def list(self, api_version, kind, namespace, label_selector=None):
        self.calls.append(("list", kind, label_selector or ""))
        want = dict(t.split("=", 1) for t in label_selector.split(",")) if label_selector else {}
        out = []
        for (av, k, ns, _), o in sorted(self.objects.items()):
            if av == api_version and k == kind and (namespace is None or ns == namespace):
                labels = o["metadata"].get("labels") or {}
                if all(labels.get(a) == b for a, b in want.items()):
                    out.append(copy.deepcopy(o))
        return out

    def log(self, namespace, pod, container, tail_lines=20, limit_bytes=16384):
        self.calls.append(("log", "Pod", pod))
        if (namespace, pod) not in self.logs:
            raise ApiError(400, "BadRequest", f"container {container} in pod {pod} is waiting to start")
        return "".join(self.logs[(namespace, pod)].splitlines(keepends=True)[-tail_lines:])[-limit_bytes:]

    # writes
    def apply(self, obj, subresource=None, field_manager="kiln-operator", force=True):
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        k = _key(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        self.calls.append(("apply" + (f"/{subresource}" if subresource else ""), obj["kind"], meta["name"]))
        cur = self.objects.get(k)
        if subresource == "status":
            if cur is None:
                raise ApiError(404, "NotFound", "not found")
            new = copy.deepcopy(cur)
            new["status"] = obj.get("status", {})
        else:
            new = copy.deepcopy(cur) if cur else {"metadata": {"uid": f"uid-{meta['name']}", "generation": 1}}
            old_spec = (cur or {}).get("spec")
            for f, v in obj.items():
                if f == "metadata":
                    new["metadata"].update({kk: vv for kk, vv in v.items() if kk != "resourceVersion"})
                elif f != "status":
                    new[f] = v
            if obj["kind"] == "Deployment" and "replicas" not in obj.get("spec", {}):
                new["spec"]["replicas"] = ((cur or {}).get("spec") or {}).get("replicas", 1)
            if cur is not None and old_spec != new.get("spec"):
                new["metadata"]["generation"] = cur["metadata"].get("generation", 1) + 1
        if new == cur:
            return copy.deepcopy(cur)
        new["metadata"]["resourceVersion"] = str(next(self.rv))
        self.objects[k] = new
        return copy.deepcopy(new)

    def set_owners(self, api_version, kind, namespace, name, owner_references):
        self.calls.append(("set_owners", kind, name))
        cur = self.objects.get(_key(api_version, kind, namespace, name))
        if cur is None:
            raise ApiError(404, "NotFound", "not found")
        cur["metadata"]["ownerReferences"] = copy.deepcopy(owner_references)
        cur["metadata"]["resourceVersion"] = str(next(self.rv))
        return copy.deepcopy(cur)

    def delete(self, api_version, kind, namespace, name, propagation="Background"):
        self.calls.append(("delete", kind, name))
        return self.objects.pop(_key(api_version, kind, namespace, name), None) is not None

    def create(self, obj):
        meta = obj["metadata"]
        k = _key(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        if k in self.objects:
            raise ApiError(409, "AlreadyExists", "exists")
        new = copy.deepcopy(obj)
        new["metadata"]["resourceVersion"] = str(next(self.rv))
        self.objects[k] = new
        return copy.deepcopy(new)

    def replace(self, obj):
        meta = obj["metadata"]
        k = _key(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        cur = self.objects.get(k)
        if cur is None:
            raise ApiError(404, "NotFound", "not found")
        if meta.get("resourceVersion") != cur["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "resourceVersion mismatch")
        new = copy.deepcopy(obj)
        new["metadata"]["resourceVersion"] = str(next(self.rv))
        self.objects[k] = new
        return copy.deepcopy(new)

    # test helpers
    def set_status(self, api_version, kind, namespace, name, status: dict[str, Any]) -> None:
        self.objects[_key(api_version, kind, namespace, name)]["status"] = status

    def writes(self) -> list[tuple[str, str, str]]:
        return [c for c in self.calls if c[0] != "get" and c[0] != "list"]
