"""The router's discovery and its scale-to-zero signal against a real API server (the test
plane; no operator): InferenceEngines and EndpointSlices are watched into the routing table,
and a request held for an engine with ``minReplicas: 0`` writes the activity annotation.

    .venv/bin/python -m pytest -q -m cluster tests/router/test_router_cluster.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from router_testutil import MODEL

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def wait_until(what, fn, stall=60.0):
    end = time.monotonic() + stall
    while not fn():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


def models(router) -> dict:
    return {m["id"]: m for m in httpx.get(f"{router.base}/v1/models", timeout=10).json()["data"]}


def test_watches_feed_the_table_and_a_held_request_signals_the_engine(kube_plane, namespace, make_router):
    k = kube_plane.kubectl
    k("apply", "--server-side", "-f", str(ROOT / "crds/inferenceengine.yaml"))
    k("wait", "--for=condition=Established", "crd/inferenceengines.kiln.dev", "--timeout=60s")
    router = make_router(kubeconfig=kube_plane.kubeconfig, namespaces=(namespace,), hold_timeout_seconds=3,
                         activity_seconds=1)
    wait_until("the router synced", lambda: httpx.get(f"{router.base}/ready", timeout=5).status_code == 200)
    ie = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "eng"},
          "spec": {"model": {"builtin": "smollm2-135m-instruct", "servedModelName": MODEL},
                   "adapters": [{"name": "tuned", "pvc": {"claimName": "a", "path": "x"}}],
                   "autoscaling": {"mode": "builtin", "minReplicas": 0, "scaleToZeroAfterSeconds": 30}}}
    k("apply", "-n", namespace, "-f", "-", input=json.dumps(ie))
    wait_until("the engine listed", lambda: set(models(router)) == {MODEL, "tuned"})
    assert models(router)[MODEL]["ready_replicas"] == 0

    r = httpx.post(f"{router.base}/v1/completions", json={"model": "tuned", "prompt": "x"}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_replica"  # held 3 s, nothing came
    stamp = k("get", "ie", "eng", "-n", namespace, "-o", "jsonpath={.metadata.annotations.kiln\\.dev/last-request-time}")
    assert stamp.endswith("Z") and "T" in stamp  # the router's one write: the wake-up signal
    managers = json.loads(k("get", "ie", "eng", "-n", namespace, "-o", "json", "--show-managed-fields"))
    assert any(m["manager"] == "kiln-router" for m in managers["metadata"]["managedFields"])

    def endpoint_slice(name: str, address: str, ready: bool) -> str:
        return json.dumps({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                           "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "eng"}},
                           "addressType": "IPv4", "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
                           "endpoints": [{"addresses": [address], "conditions": {"ready": ready}}]})

    # Watch events come in order: once the ready slice is seen, the not-ready one was too.
    k("apply", "-n", namespace, "-f", "-", input=endpoint_slice("eng-a", "10.244.9.8", False))
    k("apply", "-n", namespace, "-f", "-", input=endpoint_slice("eng-b", "10.244.9.9", True))
    wait_until("the ready endpoint seen", lambda: models(router)[MODEL]["ready_replicas"] >= 1)
    assert models(router)[MODEL]["ready_replicas"] == 1  # only the ready one
    k("delete", "endpointslice", "eng-b", "-n", namespace)
    wait_until("the endpoint gone", lambda: models(router)[MODEL]["ready_replicas"] == 0)

    k("patch", "ie", "eng", "-n", namespace, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    wait_until("a suspended engine unlisted", lambda: MODEL not in models(router))
    k("delete", "ie", "eng", "-n", namespace)
