"""Tests that prove the test control plane is a real one (issue: control plane, point 5)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from kiln.devcluster.paths import BUILD_SH
from kiln.devcluster.plane import KWOK_NODE_LABEL
from kiln.devcluster.wait import wait_for as _wait_for

pytestmark = pytest.mark.cluster


PROGRESS: list = []  # the plane's progress probe (set for each test by _waits_follow_the_plane)


@pytest.fixture(autouse=True)
def _waits_follow_the_plane(kube_plane):
    PROGRESS[:] = [kube_plane.progress]


def wait_for(what: str, fn, timeout: float = 60, interval: float = 0.5):
    """Polls fn until it returns something truthy; returns that, or fails naming what once for
    `timeout` seconds neither fn's answer nor the plane's objects changed (kiln.devcluster.wait)."""
    try:
        return _wait_for(what, fn, stall=timeout, interval=interval, progress=PROGRESS[0] if PROGRESS else None)
    except TimeoutError as e:
        pytest.fail(str(e))


def deployment(name: str, replicas: int, gpus: int = 0, labels: dict | None = None) -> dict:
    labels = labels or {"app": name}
    container = {"name": "main", "image": "kiln/fake:latest"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}}


def apply(plane, ns: str, obj) -> None:
    plane.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))


def pods(plane, ns: str, selector: str) -> list[dict]:
    return plane.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]


def is_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def test_versions_are_the_pinned_release(kube_plane):
    v = json.loads(kube_plane.kubectl("version", "-o", "json"))
    assert v["clientVersion"]["gitVersion"] == v["serverVersion"]["gitVersion"]
    assert v["serverVersion"]["gitVersion"].startswith("v1.3")
    helm = subprocess.run([kube_plane.helm_bin, "version", "--short"], capture_output=True, text=True, check=True)
    assert helm.stdout.startswith("v3.")


def test_plane_runs_from_the_cached_binaries_and_records_its_start_time(kube_plane):
    # The start time (etcd to every readiness check, measured by Plane.up; absent for a reused
    # plane) is a measurement printed in the run's summary, not asserted: CI machines are noisy.
    cached = subprocess.run(["bash", str(BUILD_SH), "--print"],
                            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    assert Path(kube_plane.state["bin"]) == Path(cached)
    for daemon, pid in kube_plane.state["pids"].items():
        assert Path(f"/proc/{pid}").exists(), f"{daemon} (pid {pid}) is not running"
    started = kube_plane.state.get("started_s")
    assert started is None or started > 0


def test_gpu_nodes_are_ready_with_capacity(kube_plane):
    nodes = kube_plane.kubectl_json("get", "nodes", "-l", f"{KWOK_NODE_LABEL}=kwok")["items"]
    assert len(nodes) == kube_plane.num_gpu_nodes
    for n in nodes:
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == str(kube_plane.gpus_per_node)
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])


@pytest.fixture
def widget_crd(kube_plane):
    group = f"t{uuid.uuid4().hex[:8]}.plane-test.kiln.dev"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {"group": group, "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object",
                     "properties": {"spec": {
                         "type": "object", "required": ["minReplicas", "maxReplicas"],
                         "properties": {"minReplicas": {"type": "integer", "minimum": 0},
                                        "maxReplicas": {"type": "integer", "minimum": 1},
                                        "mode": {"type": "string", "enum": ["queue", "none"]}},
                         "x-kubernetes-validations": [{"rule": "self.minReplicas <= self.maxReplicas",
                                                       "message": "minReplicas must not exceed maxReplicas"}]}}}}}]}}
    kube_plane.apply(crd)
    kube_plane.kubectl("wait", "--for=condition=Established", f"crd/widgets.{group}", "--timeout=30s")
    yield group
    kube_plane.kubectl("delete", "crd", f"widgets.{group}", "--wait=false", check=False)


def test_crd_schema_and_cel_are_enforced_by_the_server(kube_plane, namespace, widget_crd):
    def widget(name, **spec):
        return {"apiVersion": f"{widget_crd}/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}

    def create(obj):
        return subprocess.run([kube_plane.kubectl_bin, "--kubeconfig", kube_plane.kubeconfig, "create", "-n",
                               namespace, "-f", "-"], input=json.dumps(obj), capture_output=True, text=True)

    # Apply right after Established can race the discovery cache: retry the good one briefly.
    wait_for("valid widget accepted", lambda: create(widget("ok", minReplicas=1, maxReplicas=2)).returncode == 0, 20)
    bad_cel = create(widget("cel", minReplicas=3, maxReplicas=2))
    assert bad_cel.returncode != 0 and "minReplicas must not exceed maxReplicas" in bad_cel.stderr
    bad_type = create(widget("type", minReplicas="one", maxReplicas=2))
    assert bad_type.returncode != 0 and "spec.minReplicas" in bad_type.stderr
    bad_enum = create(widget("enum", minReplicas=0, maxReplicas=2, mode="fast"))
    assert bad_enum.returncode != 0 and "Unsupported value" in bad_enum.stderr
    assert kube_plane.kubectl("get", "widgets", "-n", namespace, "-o", "name").split() == ["widget.%s/ok" % widget_crd]


def test_deployment_gets_ready_pods_on_gpu_nodes_and_the_rest_stay_pending(kube_plane, namespace):
    # The plane's kwok-gpu-* nodes are shared by every test of the run, so a tainted node of our own
    # with 2 GPUs holds exactly this test's pods: 3 pods of 1 GPU -> 2 Ready, 1 Pending.
    node = f"gpu-{namespace[-6:]}"
    taint = {"key": "kiln.dev/test", "value": namespace, "effect": "NoSchedule"}
    kube_plane.add_node(node, 2, labels={"kiln.dev/test": namespace}, taints=[taint])
    try:
        wait_for(f"node {node} Ready", lambda: is_ready(kube_plane.kubectl_json("get", "node", node)), 30)
        dep = deployment("gpu", 3, gpus=1)
        dep["spec"]["template"]["spec"].update(
            nodeSelector={"kiln.dev/test": namespace},
            tolerations=[{"key": "kiln.dev/test", "operator": "Equal", "value": namespace, "effect": "NoSchedule"}])
        apply(kube_plane, namespace, dep)

        def split():
            ps = pods(kube_plane, namespace, "app=gpu")
            ready = [p for p in ps if is_ready(p)]
            pending = [p for p in ps if p["status"].get("phase") == "Pending" and not p["spec"].get("nodeName")
                       and any(c["type"] == "PodScheduled" for c in p["status"].get("conditions", []))]
            return (ready, pending) if len(ready) == 2 and len(pending) == 1 else None

        ready, pending = wait_for("2 ready and 1 pending pod", split, 60)
        assert {p["spec"]["nodeName"] for p in ready} == {node}
        assert all(p["status"].get("podIP") for p in ready)
        cond = next(c for c in pending[0]["status"]["conditions"] if c["type"] == "PodScheduled")
        assert cond["status"] == "False" and "Insufficient nvidia.com/gpu" in cond["message"]
        wait_for("Deployment readyReplicas 2", lambda: kube_plane.kubectl_json(
            "get", "deployment", "gpu", "-n", namespace)["status"].get("readyReplicas") == 2, 30)
    finally:
        kube_plane.kubectl("delete", "node", node, "--wait=false", check=False)


def test_pods_land_on_the_plane_gpu_nodes(kube_plane, namespace):
    apply(kube_plane, namespace, deployment("one", 1, gpus=1))
    (pod,) = wait_for("a ready pod", lambda: [p for p in pods(kube_plane, namespace, "app=one") if is_ready(p)], 60)
    assert pod["spec"]["nodeName"].startswith("kwok-gpu-")


def test_job_pod_completes(kube_plane, namespace):
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "once"},
           "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [
               {"name": "main", "image": "kiln/fake:latest", "command": ["true"]}]}}}}
    apply(kube_plane, namespace, job)
    wait_for("job/once Complete", lambda: any(
        c["type"] == "Complete" and c["status"] == "True"
        for c in kube_plane.kubectl_json("get", "job", "once", "-n", namespace).get("status", {}).get("conditions", [])), 60)
    (pod,) = pods(kube_plane, namespace, "job-name=once")
    assert pod["status"]["phase"] == "Succeeded"


def test_deleting_an_owner_garbage_collects_its_children(kube_plane, namespace):
    apply(kube_plane, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    uid = kube_plane.kubectl_json("get", "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    apply(kube_plane, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "child", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]}})
    apply(kube_plane, namespace, deployment("web", 1))
    wait_for("a ReplicaSet of web", lambda: kube_plane.kubectl("get", "rs", "-n", namespace, "-l", "app=web", "-o", "name"))
    kube_plane.kubectl("delete", "configmap", "owner", "-n", namespace)
    kube_plane.kubectl("delete", "deployment", "web", "-n", namespace)
    wait_for("child ConfigMap collected", lambda: not kube_plane.kubectl(
        "get", "configmap", "child", "-n", namespace, "--ignore-not-found", "-o", "name"))
    wait_for("ReplicaSet and pods collected", lambda: not kube_plane.kubectl(
        "get", "rs,pods", "-n", namespace, "-l", "app=web", "-o", "name"))


def test_rbac_restricted_identity_is_refused(kube_plane, namespace):
    kube_plane.kubectl("create", "serviceaccount", "limited", "-n", namespace)
    kube_plane.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", namespace)
    kube_plane.kubectl("create", "rolebinding", "limited-reads-pods", "--role=pod-reader",
                       f"--serviceaccount={namespace}:limited", "-n", namespace)
    token = kube_plane.kubectl("create", "token", "limited", "-n", namespace).strip()

    def as_limited(*args):
        return subprocess.run([kube_plane.kubectl_bin, "--kubeconfig=/dev/null", f"--server={kube_plane.server}",
                               f"--certificate-authority={kube_plane.pki / 'ca.crt'}", f"--token={token}",
                               "-n", namespace, *args], capture_output=True, text=True)

    allowed = as_limited("get", "pods")
    assert allowed.returncode == 0, allowed.stderr
    denied = as_limited("get", "secrets")
    assert denied.returncode != 0 and "Forbidden" in denied.stderr
    assert f"system:serviceaccount:{namespace}:limited" in denied.stderr
    assert as_limited("auth", "can-i", "delete", "pods").stdout.strip() == "no"


def test_custom_metrics_api_serves_fed_values_through_the_aggregator(kube_plane, namespace):
    apply(kube_plane, namespace, deployment("web", 2))
    wait_for("2 ready pods", lambda: len([p for p in pods(kube_plane, namespace, "app=web") if is_ready(p)]) == 2)
    (first, second) = sorted(p["metadata"]["name"] for p in pods(kube_plane, namespace, "app=web"))
    kube_plane.custom_metrics.set(namespace, {"app": "web"}, "kiln_test_metric", 1.5)
    kube_plane.custom_metrics.set(namespace, first, "kiln_test_metric", 4)
    raw = json.loads(kube_plane.kubectl(
        "get", "--raw", f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{namespace}/pods/*/kiln_test_metric"
        "?labelSelector=app%3Dweb"))
    values = {i["describedObject"]["name"]: i["value"] for i in raw["items"]}
    assert values == {first: "4", second: "1500m"}


def test_hpa_scales_a_deployment_on_a_fed_pods_metric(kube_plane, namespace):
    apply(kube_plane, namespace, deployment("web", 1))
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "web"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"},
                    "minReplicas": 1, "maxReplicas": 4,
                    "metrics": [{"type": "Pods", "pods": {"metric": {"name": "kiln_queue_seconds"},
                                                          "target": {"type": "AverageValue", "averageValue": "1"}}}]}}
    apply(kube_plane, namespace, hpa)
    kube_plane.custom_metrics.set(namespace, {"app": "web"}, "kiln_queue_seconds", 0.5)

    def replicas():
        return kube_plane.kubectl_json("get", "deployment", "web", "-n", namespace)["spec"]["replicas"]

    def hpa_current():
        st = kube_plane.kubectl_json("get", "hpa", "web", "-n", namespace).get("status", {})
        cur = [m["pods"]["current"]["averageValue"] for m in st.get("currentMetrics") or [] if m.get("type") == "Pods"]
        return cur[0] if cur else None

    assert wait_for("HPA reads the fed metric", hpa_current, 60) == "500m"
    assert replicas() == 1
    # 1 pod at 3 s against a 1 s target: the HPA wants ceil(1 * 3 / 1) = 3 replicas.
    kube_plane.custom_metrics.set(namespace, {"app": "web"}, "kiln_queue_seconds", 3)
    wait_for("scale up to 3", lambda: replicas() == 3, 60)
    wait_for("3 ready pods", lambda: len([p for p in pods(kube_plane, namespace, "app=web") if is_ready(p)]) == 3)
    # Load gone: 3 pods at 0.2 s -> ceil(3 * 0.2) = 1, after the 10 s downscale stabilization window.
    kube_plane.custom_metrics.set(namespace, {"app": "web"}, "kiln_queue_seconds", 0.2)
    wait_for("scale down to 1", lambda: replicas() == 1, 90)


def test_helm_installs_a_chart(kube_plane, namespace, tmp_path):
    env = kube_plane.env()
    subprocess.run([kube_plane.helm_bin, "create", str(tmp_path / "demo")], check=True, env=env, capture_output=True)
    r = subprocess.run([kube_plane.helm_bin, "install", "demo", str(tmp_path / "demo"), "-n", namespace,
                        "--wait", "--timeout", "90s"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "STATUS: deployed" in r.stdout, r.stdout + r.stderr
    # helm --wait reads the ReplicaSet; the Deployment's status follows a moment later.
    wait_for("Deployment demo ready", lambda: kube_plane.kubectl_json(
        "get", "deployment", "demo", "-n", namespace)["status"].get("readyReplicas") == 1, 30)


def test_nodes_of_another_kind_are_left_alone_by_kwok(kube_plane):
    name = f"proc-{uuid.uuid4().hex[:6]}"
    kube_plane.add_node(name, 1, kind="process")
    try:
        time.sleep(3)  # kwok initializes its nodes in well under a second
        node = kube_plane.kubectl_json("get", "node", name)
        assert not any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "1"
    finally:
        kube_plane.kubectl("delete", "node", name, "--wait=false", check=False)
