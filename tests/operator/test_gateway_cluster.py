"""spec.gateway and autoscaling mode keda against the real API server of the test plane: first
without their CRDs (conditions with a reason; the engine still serves), then with the CRDs of
the Gateway API, the Gateway API Inference Extension and KEDA installed from their Go modules
(kiln.devcluster.crds): the API server accepts the HTTPRoute, InferencePool, endpoint picker
and ScaledObject as the builders make them (nothing pruned), and refuses what their schemas
refuse.  The operator runs in this process with the chart's ServiceAccount token.
"""

from __future__ import annotations

import copy
import json
import subprocess

import pytest

from kiln.devcluster.fixtures import skip_or_fail_in_ci
from kiln.operator import builders_autoscaling as ba
from kiln.operator import builders_gateway as bg
from kiln.operator.spec import parse_spec

from test_operator_cluster import (admin, apply, condition, get_ie, load, metrics, ns, operator, plane,  # noqa: F401
                                   ready, release, wait_for)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

GATEWAY = {"httpRoute": {"parentRefs": [{"name": "inference-gw", "sectionName": "http"}],
                         "hostnames": ["llm.example.com"]},
           "inferencePool": {"enabled": True}}
KEDA = {"mode": "keda", "minReplicas": 2, "maxReplicas": 4, "metric": "waitingRequests", "target": 3,
        "keda": {"serverAddress": "http://prometheus.monitoring:9090", "pollingIntervalSeconds": 5}}


def engine(name: str, **spec) -> dict:
    obj = load("smollm2.yaml")
    obj["metadata"]["name"] = name
    obj["spec"].update(spec)
    return obj


def subset(want, got) -> bool:
    """``want`` is contained in ``got`` (the API server may add defaults, never drop a field)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and subset(v, got[k]) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(got, list) and len(want) == len(got) and all(subset(a, b) for a, b in zip(want, got))
    return want == got


def install_crds(plane):
    from kiln.devcluster.crds import crd_files
    try:
        files = [f for name in ("gateway-api", "inference-extension", "keda") for f in crd_files(name)]
    except FileNotFoundError as e:
        skip_or_fail_in_ci(f"the CRDs could not be fetched through the Go module proxy: {e}")
    for f in files:
        plane.kubectl("apply", "--server-side", "-f", str(f))
    for f in files:
        plane.kubectl("wait", "--for=condition=Established", "-f", str(f), "--timeout=60s")


def test_without_the_crds_the_engine_serves_and_says_what_is_missing(plane, admin, ns):
    if admin.served_kinds("gateway.networking.k8s.io/v1"):
        pytest.skip("the plane already has the Gateway API CRDs (a reused plane)")
    apply(plane, ns, engine("gw-missing", gateway=GATEWAY, autoscaling=KEDA))
    ie = wait_for("Ready", lambda: ready(admin, ns, "gw-missing"), 90)
    exposed = wait_for("Exposed", lambda: condition(get_ie(admin, ns, "gw-missing"), "Exposed") or None, 30)
    assert (exposed["status"], exposed["reason"]) == ("False", "GatewayAPINotInstalled")
    assert "HTTPRoute" in exposed["message"] and "InferencePool" in exposed["message"]
    scaler = condition(ie, "ScalerReady")
    assert (scaler["status"], scaler["reason"]) == ("False", "KEDANotInstalled")
    assert condition(ie, "Degraded")["status"] == "False"
    assert admin.get("apps/v1", "Deployment", ns, "gw-missing")["spec"]["replicas"] == 2  # minReplicas meanwhile
    assert admin.get("v1", "Service", ns, "gw-missing") is not None


def test_with_the_crds_the_api_server_accepts_what_the_builders_make(plane, admin, ns):
    install_crds(plane)
    obj = engine("gw", gateway=GATEWAY, autoscaling=KEDA)
    apply(plane, ns, obj)
    wait_for("Exposed", lambda: condition(get_ie(admin, ns, "gw"), "Exposed").get("status") == "True", 90)
    ie = wait_for("ScalerReady", lambda: (lambda x: x if condition(x, "ScalerReady").get("status") == "True" else None)(
        get_ie(admin, ns, "gw")), 60)
    assert ie["status"]["gateway"]["httpRoute"] == {"name": "gw", "backend": "InferencePool"}
    owner = {"name": "gw", "namespace": ns, "uid": ie["metadata"]["uid"]}
    spec = parse_spec(ie["spec"])
    pool_uid = admin.get("inference.networking.k8s.io/v1", "InferencePool", ns, "gw")["metadata"]["uid"]
    for built in (bg.http_route(spec, owner, to_pool=True), bg.inference_pool(spec, owner),
                  ba.scaled_object(spec, owner), *bg.endpoint_picker(spec, owner, pool_uid)):
        got = admin.get(built["apiVersion"], built["kind"], ns, built["metadata"]["name"])
        assert got is not None, built["kind"]
        body = {k: v for k, v in built.items() if k not in ("apiVersion", "kind", "metadata")}
        assert subset(body, got), (built["kind"], json.dumps(got)[:2000])

    # the schemas are enforced: an unknown field and a wrong type are refused
    so = ba.scaled_object(spec, owner)
    bad_field = copy.deepcopy(so)
    bad_field["spec"]["triggers"][0]["metadatum"] = {}
    bad_type = copy.deepcopy(so)
    bad_type["spec"]["pollingInterval"] = "often"
    pool = bg.inference_pool(spec, owner)
    bad_pool = copy.deepcopy(pool)
    del bad_pool["spec"]["endpointPickerRef"]["port"]  # the extension's CEL rule: a Service needs a port
    for bad, word in ((bad_field, "metadatum"), (bad_type, "pollingInterval"), (bad_pool, "port")):
        bad["metadata"]["name"] = "gw-bad"  # a new object: nothing merged from the operator's apply
        r = subprocess.run([plane.kubectl_bin, "--kubeconfig", plane.kubeconfig, "apply", "--server-side",
                            "--dry-run=server", "--validate=strict", "-f", "-"], input=json.dumps(bad),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and word in r.stderr, (bad["kind"], r.stderr)

    # the router's queue (metric routerQueue): the HPA's External metric and the ScaledObject's
    # AverageValue trigger pass the API server's and KEDA's schemas as built, nothing pruned
    rq = parse_spec({**ie["spec"], "autoscaling": {**KEDA, "metric": "routerQueue"}})
    for built in (ba.hpa(rq, owner), ba.scaled_object(rq, owner)):
        built["metadata"]["name"] = "gw-router-queue"
        r = subprocess.run([plane.kubectl_bin, "--kubeconfig", plane.kubeconfig, "apply", "--server-side",
                            "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-"], input=json.dumps(built),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (built["kind"], r.stderr)
        body = {k: v for k, v in built.items() if k not in ("apiVersion", "kind", "metadata")}
        assert subset(body, json.loads(r.stdout)), (built["kind"], r.stdout[:2000])

    # dropping spec.gateway and leaving mode keda delete what was applied (the picker goes with its pool)
    obj["spec"].pop("gateway")
    obj["spec"]["autoscaling"] = {"mode": "off"}
    apply(plane, ns, obj)
    gone = (("gateway.networking.k8s.io/v1", "HTTPRoute", "gw"), ("inference.networking.k8s.io/v1", "InferencePool", "gw"),
            ("keda.sh/v1alpha1", "ScaledObject", "gw"), ("apps/v1", "Deployment", "gw-epp"),
            ("rbac.authorization.k8s.io/v1", "RoleBinding", "gw-epp"))
    wait_for("gateway children deleted", lambda: all(admin.get(av, k, ns, n) is None for av, k, n in gone), 60)
    ie = get_ie(admin, ns, "gw")
    assert not condition(ie, "Exposed") and "gateway" not in ie["status"] and "scaledObject" not in ie["status"]
