"""Integration tests of the operator against the real control plane (kiln.devcluster): the chart
is installed with helm, and the operator runs in this process with the chart's ServiceAccount
token (so a missing RBAC rule fails the test).  kwok fakes the pods: build Jobs complete through
kwok's pod-complete stage, serving pods become Ready without running.

The builtin autoscaler's scrapes are answered by a fake fetcher (kwok pod IPs are not real).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kiln.devcluster.wait import wait_for as _wait_for
from kiln.operator import builders as b
from kiln.operator import constants as c
from kiln.operator.kube import Kube, KubeConfig
from kiln.operator.main import OperatorOptions, start_in_thread
from kiln.common.enginespec import engine_hash

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
RELEASE_NS = "kiln-system"
SA = "kiln"


# --- helpers -----------------------------------------------------------------------------------

PROGRESS: list = []  # the plane's progress probe, set by the `plane` fixture


def wait_for(what, fn, timeout=60.0, interval=0.3):
    """fn's truthy answer; TimeoutError once for `timeout` seconds neither that answer nor the
    plane's objects changed (kiln.devcluster.wait: a loaded machine is slower, not failed)."""
    return _wait_for(what, fn, stall=timeout, interval=interval, progress=PROGRESS[0] if PROGRESS else None)


class FakeMetrics:
    """Answers the builtin autoscaler's scrapes: per-pod histogram totals that grow by
    (queue seconds, requests) per scrape, as set by the test; a router pod's scrape is the real
    router exposition (``RouterMetrics``) with the queue the test sets."""

    def __init__(self):
        from kiln.operator.router.metrics import RouterMetrics
        self.step = (0.0, 1.0)
        self.totals: dict[str, list[float]] = {}
        self.scrapes = 0
        self.router = RouterMetrics()
        self.router_scrapes = 0

    def __call__(self, pod):
        if pod["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router":
            from prometheus_client import generate_latest
            self.router_scrapes += 1
            return generate_latest(self.router.registry).decode()
        self.scrapes += 1
        t = self.totals.setdefault(pod["metadata"]["name"], [0.0, 0.0])
        t[0] += self.step[0]
        t[1] += self.step[1]
        return (f"kiln_request_queue_time_seconds_sum {t[0]}\n"
                f"kiln_request_queue_time_seconds_count {t[1]}\n")


class Operator:
    """The in-process operator (restartable)."""

    def __init__(self, kubeconfig: str, metrics: FakeMetrics, router_selector: str = ""):
        self.kubeconfig, self.metrics, self.router_selector = kubeconfig, metrics, router_selector
        self.handle = None

    def options(self, identity="pytest-a"):
        return OperatorOptions(kubeconfig=self.kubeconfig, leader_election=True, lease_namespace=RELEASE_NS,
                               lease_name="kiln", identity=identity, resync_seconds=5, autoscale_seconds=1,
                               workers=8, metrics_fetcher=self.metrics, router_namespace=RELEASE_NS,
                               router_selector=self.router_selector)

    def start(self, identity="pytest-a"):
        self.handle = start_in_thread(self.options(identity), wait_ready=60)
        assert self.handle.ready_flag.is_set(), f"operator not ready: {self.handle.errors}"
        return self.handle

    def stop(self):
        if self.handle is not None:
            self.handle.stop()
            self.handle = None


@pytest.fixture(scope="module")
def plane(kube_plane):
    PROGRESS[:] = [kube_plane.progress]
    return kube_plane


@pytest.fixture(scope="module")
def admin(plane):
    k = Kube(KubeConfig(kubeconfig=plane.kubeconfig))
    yield k
    k.close()


@pytest.fixture(scope="module")
def release(plane, tmp_path_factory):
    """helm install of the chart; returns a kubeconfig with the chart ServiceAccount's token."""
    env = plane.env()
    r = subprocess.run([plane.helm_bin, "upgrade", "--install", "kiln", str(ROOT / "helm/kiln"),
                        "--namespace", RELEASE_NS, "--create-namespace", "--kubeconfig", plane.kubeconfig,
                        "--set", "runtimeImage.tag=test", "--wait", "--timeout", "120s"],
                       capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    token = plane.kubectl("create", "token", SA, "-n", RELEASE_NS, "--duration=3h").strip()
    kc = tmp_path_factory.mktemp("sa") / "kubeconfig"
    kc.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "plane", "cluster": {"server": plane.server,
                                                    "certificate-authority": str(plane.pki / "ca.crt")}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "plane", "user": "sa"}}]}))
    yield str(kc)
    subprocess.run([plane.helm_bin, "uninstall", "kiln", "--namespace", RELEASE_NS, "--kubeconfig", plane.kubeconfig],
                   capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def metrics():
    return FakeMetrics()


def chart_flag(admin, flag: str) -> str:
    """The value of ``--flag=`` in the args of the chart's operator Deployment ("" without it)."""
    args = admin.get("apps/v1", "Deployment", RELEASE_NS, "kiln")["spec"]["template"]["spec"]["containers"][0]["args"]
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"{flag}=")), "")


@pytest.fixture(scope="module")
def operator(release, metrics, admin):
    op = Operator(release, metrics, router_selector=chart_flag(admin, "--router-selector"))
    op.start()
    yield op
    op.stop()


@pytest.fixture
def ns(plane, namespace, operator):
    """A test namespace with a PersistentVolume pre-bound to its engine cache claim (the plane
    has no storage provisioner)."""
    pv = f"kiln-cache-{namespace}"[:63]
    plane.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                 "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                          "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                          "hostPath": {"path": f"/tmp/kiln-pv/{namespace}"},
                          "claimRef": {"namespace": namespace, "name": "kiln-engine-cache"}}})
    yield namespace
    plane.kubectl("delete", "pv", pv, "--wait=false", "--ignore-not-found", check=False)


def load(name: str, **spec_overrides) -> dict:
    obj = yaml.safe_load((ROOT / "examples" / name).read_text())
    for k, v in spec_overrides.items():
        obj["spec"][k] = v
    return obj


def apply(plane, ns: str, obj: dict, *extra: str) -> str:
    return plane.kubectl("apply", "-n", ns, *extra, "-f", "-", input=json.dumps(obj))


def get_ie(admin, ns, name):
    return admin.get(c.API_VERSION, c.KIND, ns, name)


def condition(body, t):
    for x in (body or {}).get("status", {}).get("conditions", []):
        if x["type"] == t:
            return x
    return {}


def deployment_hash(admin, ns, name):
    d = admin.get("apps/v1", "Deployment", ns, name)
    return d and d["spec"]["template"]["metadata"]["labels"].get(c.LABEL_ENGINE_HASH)


def ready(admin, ns, name):
    ie = get_ie(admin, ns, name)
    return ie if ie and ie.get("status", {}).get("phase") == "Ready" \
        and ie["status"].get("observedGeneration") == ie["metadata"]["generation"] else None


def replica_sets(admin, ns, name):
    return admin.request("GET", f"/apis/apps/v1/namespaces/{ns}/replicasets",
                         query={"labelSelector": f"{c.LABEL_ENGINE}={name}"})["items"]


# --- tests -------------------------------------------------------------------------------------

def test_chart_installs_crd_rbac_and_operator(plane, admin, release):
    crd = admin.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferenceengines.kiln.dev")
    assert any(x["type"] == "Established" and x["status"] == "True" for x in crd["status"]["conditions"])
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    dep = admin.get("apps/v1", "Deployment", RELEASE_NS, "kiln")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == SA
    # the ServiceAccount may not touch what it does not need: Secrets are read by name only (the
    # API key of runtime.apiKeySecretRef, for the pods' LoRA load/unload calls), never listed
    out = plane.kubectl("auth", "can-i", "list", "secrets", "-A", f"--as=system:serviceaccount:{RELEASE_NS}:{SA}",
                        check=False).strip()
    assert out == "no"
    # the default (unrestricted cluster scope) is what the docs say it is: writes everywhere, no secrets listed
    sa = f"--as=system:serviceaccount:{RELEASE_NS}:{SA}"
    for verb, what, ns_, want in (("create", "deployments.apps", "kube-system", "yes"), ("patch", "jobs.batch", "default", "yes"),
                                  ("watch", "pods", "default", "yes"), ("create", "pods", "default", "no"),
                                  ("delete", "deployments.apps", "default", "no"), ("list", "secrets", "default", "no"),
                                  ("watch", "secrets", "default", "no"), ("get", "secrets", "default", "yes"),
                                  ("list", "nodes", "", "no")):
        args = ["auth", "can-i", verb, what, sa] + (["-n", ns_] if ns_ else [])
        assert plane.kubectl(*args, check=False).strip() == want, (verb, what, ns_)


def test_kubectl_explain_shows_defaults_and_smoothquant_alpha_is_a_number(plane, release, ns):
    """`kubectl explain` prints the description, not the schema's `default:`; each says its default."""
    for field, want in (("spec.build.groupSize", "Default: 128."), ("spec.build.smoothquantAlpha", "Default: 0.5."),
                        ("spec.autoscaling.maxReplicas", "Default: the larger of 4 and"),
                        ("spec.storage.accessModes", "Default: [ReadWriteOnce].")):
        out = " ".join(plane.kubectl("explain", f"inferenceengines.{field}").split())
        assert want in out, (field, out)
    assert "<number>" in plane.kubectl("explain", "inferenceengines.spec.build.smoothquantAlpha")
    obj = load("smollm2.yaml")
    obj["spec"]["build"] = {"quantization": "int8-smoothquant", "smoothquantAlpha": "500m"}
    r = subprocess.run([plane.kubectl_bin, "--kubeconfig", plane.kubeconfig, "apply", "-n", ns, "--dry-run=server",
                        "-f", "-"], input=json.dumps(obj), capture_output=True, text=True)
    assert r.returncode != 0 and "smoothquantAlpha" in r.stderr, r.stderr


def test_invalid_examples_are_rejected_with_the_cel_message(plane, ns):
    for path in sorted((ROOT / "examples/invalid").glob("*.yaml")):
        text = path.read_text()
        expected = text.split('Rejected by the API server: "', 1)[1].split('"', 1)[0]
        r = subprocess.run([plane.kubectl_bin, "--kubeconfig", plane.kubeconfig, "apply", "-n", ns, "-f", str(path)],
                           capture_output=True, text=True)
        assert r.returncode != 0 and expected in r.stderr, (path.name, r.stderr)


def test_valid_examples_reconcile_to_their_children(plane, admin, ns):
    names = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        plane.kubectl("apply", "-n", ns, "-f", str(path))
        names.append((obj["metadata"]["name"], obj))
    for name, obj in names:
        ie = wait_for(f"{name} status", lambda: (lambda x: x if x and x.get("status", {}).get("engineHash") else None)(
            get_ie(admin, ns, name)), 60)
        assert ie["status"]["engineHash"] == engine_hash(ie["spec"])
        owner = {"name": name, "namespace": ns, "uid": ie["metadata"]["uid"]}
        assert admin.get("v1", "Service", ns, b.deployment_name(owner)) is not None
        claim = (obj["spec"].get("storage") or {}).get("claimName", "kiln-engine-cache")
        assert admin.get("v1", "PersistentVolumeClaim", ns, claim) is not None
        has_job = admin.get("batch/v1", "Job", ns, b.job_name(claim, ie["status"]["engineHash"])) is not None
        has_record = admin.get("v1", "ConfigMap", ns, b.record_name(claim, ie["status"]["engineHash"])) is not None
        assert has_job or has_record
        assert ie["status"]["selector"] == b.selector_string(owner)
    # the cached-claim examples finish: smollm2 becomes Ready
    wait_for("smollm2 Ready", lambda: ready(admin, ns, "smollm2"), 90)
    # no kopf state on the resources
    for name, _ in names:
        meta = get_ie(admin, ns, name)["metadata"]
        assert not [a for a in (meta.get("annotations") or {}) if "kopf" in a]
        assert not meta.get("finalizers")


def test_build_success_gives_a_deployment_with_the_engine_hash(plane, admin, ns):
    obj = load("smollm2.yaml", replicas=2)
    apply(plane, ns, obj)
    ie = wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 90)
    h = engine_hash(ie["spec"])
    assert ie["status"]["engineHash"] == h and deployment_hash(admin, ns, "smollm2") == h
    dep = admin.get("apps/v1", "Deployment", ns, "smollm2")
    assert dep["spec"]["replicas"] == 2
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--engine") + 1] == f"/engines/{h}"
    assert ie["status"]["readyReplicas"] == 2 and ie["status"]["replicas"] == 2
    assert ie["status"]["endpoint"] == f"http://smollm2.{ns}.svc:8000/v1"
    for t, s in (("EngineBuilt", "True"), ("Available", "True"), ("Progressing", "False"), ("Degraded", "False")):
        x = condition(ie, t)
        assert x["status"] == s and x["observedGeneration"] == ie["metadata"]["generation"] and x["lastTransitionTime"]
    job = admin.get("batch/v1", "Job", ns, b.job_name("kiln-engine-cache", h))
    assert job["metadata"]["ownerReferences"][0]["uid"] == ie["metadata"]["uid"]
    events = admin.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    reasons = {e["reason"] for e in events if e["involvedObject"].get("name") == "smollm2"}
    assert {"BuildSucceeded", "MinimumReplicasAvailable"} <= reasons
    # the scale subresource works
    plane.kubectl("scale", "-n", ns, "ie/smollm2", "--replicas=3")
    wait_for("3 replicas", lambda: admin.get("apps/v1", "Deployment", ns, "smollm2")["spec"]["replicas"] == 3, 30)


def test_build_failure_is_degraded_with_the_job_reason(plane, admin, ns):
    obj = load("smollm2.yaml")
    obj["spec"]["build"]["activeDeadlineSeconds"] = 5
    obj["spec"]["resources"]["nodeSelector"] = {"kiln.dev/no-such-node": "true"}  # never schedules
    apply(plane, ns, obj)
    ie = wait_for("Degraded", lambda: (lambda x: x if condition(x, "Degraded").get("status") == "True" else None)(
        get_ie(admin, ns, "smollm2")), 90)
    d = condition(ie, "Degraded")
    assert d["reason"] == "BuildFailed" and "DeadlineExceeded" in d["message"]
    assert ie["status"]["phase"] == "Degraded"
    assert admin.get("apps/v1", "Deployment", ns, "smollm2") is None
    time.sleep(6)  # a resync later: still one Job, still no Deployment
    assert len(admin.list("batch/v1", "Job", ns)) == 1
    assert admin.get("apps/v1", "Deployment", ns, "smollm2") is None


def test_spec_change_builds_first_then_rolls_and_revert_reuses(plane, admin, ns):
    obj = load("smollm2.yaml")
    apply(plane, ns, obj)
    ie = wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 90)
    h1 = ie["status"]["engineHash"]
    dep1 = admin.get("apps/v1", "Deployment", ns, "smollm2")
    rs1 = len(replica_sets(admin, ns, "smollm2"))
    # new quantization, and a node selector no node has yet: the new build waits
    node = "kwok-gpu-0"
    obj2 = load("smollm2.yaml")
    obj2["spec"]["build"]["quantization"] = "int4-awq"
    obj2["spec"]["resources"]["nodeSelector"] = {"kiln.dev/test-pool": ns}
    apply(plane, ns, obj2)
    ie = wait_for("new hash", lambda: (lambda x: x if x["status"].get("engineHash") != h1 else None)(
        get_ie(admin, ns, "smollm2")), 30)
    h2 = ie["status"]["engineHash"]
    assert h2 == engine_hash(ie["spec"])
    wait_for("new build Job", lambda: admin.get("batch/v1", "Job", ns, b.job_name("kiln-engine-cache", h2)), 30)
    time.sleep(6)  # a resync passes; the old Deployment must stay as it was
    dep = admin.get("apps/v1", "Deployment", ns, "smollm2")
    assert dep["metadata"]["generation"] == dep1["metadata"]["generation"]
    assert deployment_hash(admin, ns, "smollm2") == h1
    assert get_ie(admin, ns, "smollm2")["status"]["phase"] == "Building"
    assert condition(get_ie(admin, ns, "smollm2"), "Available")["status"] == "True"  # old pods keep serving
    plane.kubectl("label", "node", node, f"kiln.dev/test-pool={ns}", "--overwrite")
    try:
        wait_for("rolled to the new engine", lambda: deployment_hash(admin, ns, "smollm2") == h2, 60)
        wait_for("Ready on the new engine", lambda: ready(admin, ns, "smollm2"), 90)
        assert len(replica_sets(admin, ns, "smollm2")) == rs1 + 1
        # revert: the old engine is reused, no new Job
        jobs = len(admin.list("batch/v1", "Job", ns))
        apply(plane, ns, load("smollm2.yaml"))
        wait_for("back on the old engine", lambda: deployment_hash(admin, ns, "smollm2") == h1, 30)
        ie = wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 60)
        assert condition(ie, "EngineBuilt")["reason"] in ("EngineCached", "BuildSucceeded")
        assert len(admin.list("batch/v1", "Job", ns)) == jobs
    finally:
        plane.kubectl("label", "node", node, "kiln.dev/test-pool-", check=False)


def test_applying_twice_or_server_side_changes_nothing(plane, admin, ns):
    path = ROOT / "examples/smollm2.yaml"
    plane.kubectl("apply", "-n", ns, "-f", str(path))
    ie = wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 90)
    time.sleep(1)
    before = {k: admin.get(*k[:2], ns, k[2])["metadata"]["resourceVersion"] for k in
              [("apps/v1", "Deployment", "smollm2"), ("v1", "Service", "smollm2")]}
    gen = ie["metadata"]["generation"]
    rs = len(replica_sets(admin, ns, "smollm2"))
    out = plane.kubectl("apply", "-n", ns, "-f", str(path))
    assert "unchanged" in out
    plane.kubectl("apply", "--server-side", "--field-manager=argocd-controller", "--force-conflicts", "-n", ns, "-f", str(path))
    time.sleep(7)  # more than one resync period
    after = {k: admin.get(*k[:2], ns, k[2])["metadata"]["resourceVersion"] for k in before}
    assert after == before
    assert get_ie(admin, ns, "smollm2")["metadata"]["generation"] == gen
    assert len(replica_sets(admin, ns, "smollm2")) == rs
    r = subprocess.run([plane.kubectl_bin, "--kubeconfig", plane.kubeconfig, "diff", "-n", ns, "-f", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


def test_hpa_mode_scales_on_the_custom_metric(plane, admin, ns):
    obj = load("smollm2-hpa.yaml")
    obj["spec"]["autoscaling"]["scaleDownStabilizationSeconds"] = 0
    apply(plane, ns, obj)
    wait_for("Ready", lambda: ready(admin, ns, "smollm2-hpa"), 90)
    hpa = wait_for("HPA", lambda: admin.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, "smollm2-hpa"), 30)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "kiln_request_queue_time_seconds"
    sel = {c.LABEL_ENGINE: "smollm2-hpa"}
    plane.custom_metrics.set(ns, sel, "kiln_request_queue_time_seconds", 2.0)  # 4x the 0.5 s target
    wait_for("HPA scale-up", lambda: (admin.get("apps/v1", "Deployment", ns, "smollm2-hpa")["spec"]["replicas"] or 0) >= 2, 90)
    ie = wait_for("status follows", lambda: (lambda x: x if x["status"].get("replicas", 0) >= 2 else None)(
        get_ie(admin, ns, "smollm2-hpa")), 60)
    assert ie["spec"].get("replicas", 1) == 1  # the operator never wrote replicas back
    time.sleep(6)
    assert admin.get("apps/v1", "Deployment", ns, "smollm2-hpa")["spec"]["replicas"] >= 2  # not fought back
    plane.custom_metrics.set(ns, sel, "kiln_request_queue_time_seconds", 0.0)
    wait_for("HPA scale-down", lambda: admin.get("apps/v1", "Deployment", ns, "smollm2-hpa")["spec"]["replicas"] == 1, 120)


def test_builtin_mode_scales_on_the_pods_metric(plane, admin, ns, metrics):
    obj = load("smollm2-builtin-autoscaling.yaml")
    obj["spec"]["autoscaling"].update(scaleDownStabilizationSeconds=2, maxReplicas=3)
    apply(plane, ns, obj)
    wait_for("Ready", lambda: ready(admin, ns, "smollm2-auto"), 90)
    assert admin.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, "smollm2-auto") is None
    metrics.step = (5.0, 5.0)  # 1 s mean queue time vs 0.2 s target
    wait_for("builtin scale-up", lambda: admin.get("apps/v1", "Deployment", ns, "smollm2-auto")["spec"]["replicas"] == 3, 60)
    ie = wait_for("status", lambda: (lambda x: x if x["status"].get("autoscaler", {}).get("desiredReplicas") == 3 else None)(
        get_ie(admin, ns, "smollm2-auto")), 30)
    assert ie["status"]["autoscaler"]["observedQueueTimeSeconds"] == pytest.approx(1.0)
    metrics.step = (0.0, 5.0)
    wait_for("builtin scale-down", lambda: admin.get("apps/v1", "Deployment", ns, "smollm2-auto")["spec"]["replicas"] == 1, 60)
    metrics.step = (0.0, 1.0)


def test_builtin_mode_scales_on_the_routers_queue(plane, admin, ns, metrics):
    """autoscaling.metric routerQueue: the operator finds the chart's router pods with the chart's
    --router-selector (with the chart's RBAC), reads the engine's queue from them and scales to
    ceil(queue / target)."""
    selector = chart_flag(admin, "--router-selector")
    routers = admin.list("v1", "Pod", RELEASE_NS, label_selector=selector)
    assert selector and routers and all(p["metadata"]["name"].startswith("kiln-router") for p in routers)
    obj = load("smollm2-builtin-autoscaling.yaml")
    obj["spec"]["autoscaling"] = {"mode": "builtin", "metric": "routerQueue", "target": 4, "minReplicas": 1,
                                  "maxReplicas": 4, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 2}
    apply(plane, ns, obj)
    wait_for("Ready", lambda: ready(admin, ns, "smollm2-auto"), 90)
    queue = metrics.router.queue.labels(ns, "smollm2-auto", "smollm2-auto")
    queue.set(10)  # ceil(10 / 4) = 3 replicas
    metrics.router.queue.labels("elsewhere", "smollm2-auto", "smollm2-auto").set(100)  # another namespace's engine
    try:
        wait_for("scale-up on the router's queue",
                 lambda: admin.get("apps/v1", "Deployment", ns, "smollm2-auto")["spec"]["replicas"] == 3, 60)
        st = wait_for("status", lambda: (lambda x: x["status"].get("autoscaler") if x["status"].get(
            "autoscaler", {}).get("desiredReplicas") == 3 else None)(get_ie(admin, ns, "smollm2-auto")), 30)
        assert st["metric"] == "routerQueue" and metrics.router_scrapes > 0
        queue.set(0)
        wait_for("scale-down", lambda: admin.get("apps/v1", "Deployment", ns, "smollm2-auto")["spec"]["replicas"] == 1, 60)
    finally:
        queue.set(0)


def test_suspend_scales_to_zero(plane, admin, ns):
    apply(plane, ns, load("smollm2.yaml"))
    wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 90)
    apply(plane, ns, load("smollm2.yaml", suspend=True))
    wait_for("Suspended", lambda: (get_ie(admin, ns, "smollm2")["status"].get("phase") == "Suspended"), 30)
    wait_for("0 replicas", lambda: admin.get("apps/v1", "Deployment", ns, "smollm2")["spec"]["replicas"] == 0, 30)
    apply(plane, ns, load("smollm2.yaml"))
    wait_for("Ready again", lambda: ready(admin, ns, "smollm2"), 90)


def test_restart_mid_build_resumes_without_duplicate_jobs_and_standby_waits(plane, admin, ns, operator):
    obj = load("smollm2.yaml")
    obj["spec"]["resources"]["nodeSelector"] = {"kiln.dev/test-pool": ns}
    apply(plane, ns, obj)
    wait_for("build Job", lambda: admin.list("batch/v1", "Job", ns), 30)
    # a second replica waits for the Lease while the first leads
    standby = start_in_thread(operator.options(identity="pytest-b"), wait_ready=3)
    try:
        assert not standby.ready_flag.is_set() and standby.elector is not None and not standby.elector.is_leader
        operator.stop()  # the leader goes away mid-build, releasing the Lease
        wait_for("standby leads", lambda: standby.ready_flag.is_set(), 30)
        time.sleep(6)  # it resyncs everything
        assert len(admin.list("batch/v1", "Job", ns)) == 1
        plane.kubectl("label", "node", "kwok-gpu-1", f"kiln.dev/test-pool={ns}", "--overwrite")
        wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 90)
        assert len(admin.list("batch/v1", "Job", ns)) == 1
    finally:
        plane.kubectl("label", "node", "kwok-gpu-1", "kiln.dev/test-pool-", check=False)
        standby.stop()
        operator.start()


def test_delete_removes_children_and_keeps_the_engine(plane, admin, ns):
    apply(plane, ns, load("smollm2.yaml"))
    ie = wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 90)
    h = ie["status"]["engineHash"]
    plane.kubectl("delete", "-n", ns, "ie/smollm2", "--wait=true", timeout=60)
    wait_for("children garbage-collected", lambda: admin.get("apps/v1", "Deployment", ns, "smollm2") is None
             and not admin.list("batch/v1", "Job", ns) and admin.get("v1", "Service", ns, "smollm2") is None, 60)
    assert admin.get("v1", "PersistentVolumeClaim", ns, "kiln-engine-cache") is not None
    assert admin.get("v1", "ConfigMap", ns, b.record_name("kiln-engine-cache", h)) is not None
    # re-created: served from the cached engine, no build
    apply(plane, ns, load("smollm2.yaml"))
    ie = wait_for("Ready from cache", lambda: ready(admin, ns, "smollm2"), 90)
    assert condition(ie, "EngineBuilt")["reason"] == "EngineCached"
    assert not admin.list("batch/v1", "Job", ns)


def test_namespace_scoped_install_has_enough_rbac(plane, admin, ns, tmp_path):
    """A second release in namespace mode (Roles only, no CRD): its ServiceAccount's token
    runs an operator watching one namespace, which must reconcile with only those Roles."""
    rel_ns = f"{ns}-op"[:63]
    r = subprocess.run([plane.helm_bin, "upgrade", "--install", "kiln-ns", str(ROOT / "helm/kiln"),
                        "--namespace", rel_ns, "--create-namespace", "--kubeconfig", plane.kubeconfig,
                        "--set", "crds.install=false", "--set", "rbac.scope=cluster",  # with a list: Roles only
                        "--set", f"watchNamespaces={{{ns}}}", "--set", "replicaCount=0"],
                       capture_output=True, text=True, env=plane.env(), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        assert not admin.request("GET", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
                                 query={"labelSelector": "app.kubernetes.io/instance=kiln-ns"})["items"]
        sa = f"--as=system:serviceaccount:{rel_ns}:kiln-ns"
        for verb, what, ns_, want in (("create", "deployments.apps", ns, "yes"), ("create", "deployments.apps", "kube-system", "no"),
                                      ("patch", "configmaps", "kube-system", "no"), ("create", "jobs.batch", "default", "no"),
                                      ("list", "secrets", ns, "no"), ("get", "secrets", "kube-system", "no")):
            assert plane.kubectl("auth", "can-i", verb, what, sa, "-n", ns_, check=False).strip() == want, (verb, what, ns_)
        token = plane.kubectl("create", "token", "kiln-ns", "-n", rel_ns, "--duration=1h").strip()
        kc = tmp_path / "kubeconfig"
        kc.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": [{"name": "p", "cluster": {"server": plane.server, "certificate-authority": str(plane.pki / "ca.crt")}}],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": "p", "user": "sa"}}]}))
        # (the module's cluster-wide operator acts too; any 403 of this one stays in .failures)
        op = start_in_thread(OperatorOptions(kubeconfig=str(kc), namespaces=[ns], lease_namespace=rel_ns,
                                             lease_name="kiln-ns", identity="pytest-ns", resync_seconds=5,
                                             metrics_fetcher=FakeMetrics()), wait_ready=60)
        try:
            assert op.ready_flag.is_set(), op.errors
            apply(plane, ns, load("smollm2.yaml"))
            wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 90)
            assert not op.errors and op.controller.num_reconciles > 0
            assert not op.controller.failures, op.controller.failures
            # and a missing rule is noticed: drop configmaps from the Role, reconcile again
            role = json.loads(plane.kubectl("get", "role", "kiln-ns", "-n", ns, "-o", "json"))
            for rule in role["rules"]:
                rule["resources"] = [x for x in rule["resources"] if x != "configmaps"]
            role["rules"] = [r for r in role["rules"] if r["resources"]]
            plane.kubectl("replace", "-f", "-", input=json.dumps(role))
            apply(plane, ns, load("smollm2.yaml", replicas=2))
            wait_for("a 403 on configmaps", lambda: op.controller.failures.get(f"{ns}/smollm2"), 30)
        finally:
            op.stop()
    finally:
        subprocess.run([plane.helm_bin, "uninstall", "kiln-ns", "--namespace", rel_ns, "--kubeconfig", plane.kubeconfig],
                       capture_output=True, text=True, env=plane.env(), timeout=120)
        plane.kubectl("delete", "namespace", rel_ns, "--wait=false", check=False)


# --- every failure reaches the status (issue: items 2, 3, 4) -------------------------------------

PROC_TAINT = {"key": "kiln.dev/test-proc", "value": "true", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def procnode(plane):
    """A process-backed node (real processes, kubelet-like container states), tainted so that
    only the pods of the tests that tolerate it land there."""
    from kiln.devcluster.procnode import ProcNode

    class TaintedNode(ProcNode):
        def node_object(self):
            obj = super().node_object()
            obj["spec"]["taints"] = [PROC_TAINT]
            return obj

    node = TaintedNode(plane.kubeconfig, f"proc-op-{plane.name}"[:63], gpus=4,
                       apiserver_port=plane.state["ports"]["apiserver"]).start()
    yield node
    node.stop()


def on_procnode(obj: dict, node) -> dict:
    res = obj["spec"].setdefault("resources", {})
    res["nodeSelector"] = {"kubernetes.io/hostname": node.name}
    res["tolerations"] = [{"key": PROC_TAINT["key"], "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
    return obj


def degraded(admin, ns, name, reason_prefix: str):
    """The resource once Degraded=True with a reason starting with ``reason_prefix``."""
    def check():
        ie = get_ie(admin, ns, name)
        d = condition(ie, "Degraded")
        if d.get("status") == "True" and d.get("reason", "").startswith(reason_prefix) \
                and ie["status"].get("phase") == "Degraded":
            return ie
        return None
    return wait_for(f"{name} Degraded ({reason_prefix}...)", check, 60)


def warning_event(admin, ns, name, reason):
    events = admin.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    return [e for e in events if e["involvedObject"].get("name") == name and e["reason"] == reason
            and e["type"] == "Warning"]


def test_crd_refuses_what_kubernetes_would_refuse(plane, ns):
    base = load("smollm2.yaml")
    cases = [
        (("resources", "requests"), {"cpu": "1.2.3"}), (("resources", "limits"), {"memory": "5XYZ"}),
        (("resources", "nodeSelector"), {"bad key": "x"}), (("storage", "size"), "0"),
        (("storage", "claimName"), "Bad_Claim"),
    ]
    for path, value in cases:
        obj = json.loads(json.dumps(base))
        obj["spec"].setdefault(path[0], {})[path[1]] = value
        r = subprocess.run([plane.kubectl_bin, "--kubeconfig", plane.kubeconfig, "apply", "-n", ns, "-f", "-"],
                           input=json.dumps(obj), capture_output=True, text=True)
        assert r.returncode != 0 and "spec." in r.stderr, (path, value, r.stdout, r.stderr)


def test_a_child_the_api_server_refuses_is_degraded_with_its_message_and_an_event(plane, admin, ns):
    """A toleration the CRD admits but the API server refuses (a value with operator Exists):
    before, the build Job's apply failed only in the operator's log."""
    obj = load("smollm2.yaml")
    obj["spec"]["resources"]["tolerations"] = [{"key": "gpu", "operator": "Exists", "value": "yes"}]
    apply(plane, ns, obj)
    ie = degraded(admin, ns, "smollm2", "JobRejected")
    assert "operator" in condition(ie, "Degraded")["message"]  # the API server's own words
    wait_for("a Warning event", lambda: warning_event(admin, ns, "smollm2", "JobRejected"), 30)


def test_names_with_dots_and_253_characters_reach_ready(plane, admin, ns):
    names = ["llama-3.1-8b", "m" * 240 + ".v1.2-x", "m" * 240 + ".v1.2-y"]  # the last two share 63+ chars
    for name in names:
        obj = load("smollm2.yaml")
        obj["metadata"]["name"] = name
        apply(plane, ns, obj)
    for name in names:
        wait_for(f"{name[:20]}... Ready", lambda n=name: ready(admin, ns, n), 90)
    svcs = {s["metadata"]["name"] for s in admin.list("v1", "Service", ns)}
    assert len(svcs) == 3 and all(len(s) <= 63 and "." not in s for s in svcs)
    assert len(admin.list("batch/v1", "Job", ns)) <= 1  # one spec, one build


def test_twenty_resources_with_one_spec_start_one_build_job(plane, admin, ns):
    obj = load("smollm2.yaml")
    obj["spec"]["resources"]["nodeSelector"] = {"kiln.dev/test-pool": ns}  # the build waits
    docs = []
    for i in range(20):
        o = json.loads(json.dumps(obj))
        o["metadata"]["name"] = f"shared-{i}"
        docs.append(o)
    apply(plane, ns, {"apiVersion": "v1", "kind": "List", "items": docs})
    wait_for("20 statuses", lambda: all((get_ie(admin, ns, f"shared-{i}") or {}).get("status", {}).get("engineHash")
                                         for i in range(20)), 60)
    wait_for("the Job owned by all 20", lambda: (lambda js: len(js) == 1 and len(
        js[0]["metadata"].get("ownerReferences") or []) == 20)(admin.list("batch/v1", "Job", ns)), 60)
    time.sleep(6)  # a resync later: still one
    assert len(admin.list("batch/v1", "Job", ns)) == 1
    # deleting one owner leaves the shared build running
    plane.kubectl("delete", "-n", ns, "ie/shared-0", "--wait=true", timeout=60)
    time.sleep(3)
    assert len(admin.list("batch/v1", "Job", ns)) == 1


def test_unschedulable_build_pod_is_degraded_with_the_schedulers_reason(plane, admin, ns):
    obj = load("smollm2.yaml")
    obj["spec"]["resources"]["nodeSelector"] = {"kiln.dev/no-such-pool": "x"}
    apply(plane, ns, obj)
    ie = degraded(admin, ns, "smollm2", "BuildUnschedulable")
    assert "node" in condition(ie, "Degraded")["message"]
    wait_for("a Warning event", lambda: warning_event(admin, ns, "smollm2", "BuildUnschedulable"), 30)


def test_build_pod_with_a_missing_secret_is_degraded(plane, admin, ns, procnode):
    obj = on_procnode(load("smollm2.yaml"), procnode)
    obj["spec"]["model"] = {"huggingFace": {"repo": "org/model", "revision": "a" * 40,
                                            "secretRef": {"name": "no-such-secret", "key": "token"}}}
    apply(plane, ns, obj)
    ie = degraded(admin, ns, "smollm2", "BuildCreateContainerConfigError")
    assert "no-such-secret" in condition(ie, "Degraded")["message"]


def test_failed_build_carries_the_builds_termination_message(plane, admin, ns, procnode):
    plane.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": ns},
                 "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                          "storageClassName": ""}})
    obj = on_procnode(load("smollm2.yaml"), procnode)
    obj["spec"]["model"] = {"pvc": {"claimName": "models", "path": "no-such-model"}}
    obj["spec"]["build"]["backoffLimit"] = 0
    apply(plane, ns, obj)
    ie = degraded(admin, ns, "smollm2", "BuildFailed")
    msg = condition(ie, "Degraded")["message"]
    assert "kiln build:" in msg and "no-such-model" in msg, msg  # the build's own cause, not only BackoffLimitExceeded


def test_crash_looping_serving_pods_are_degraded_with_the_last_termination_message(plane, admin, ns, procnode):
    """The engine is recorded complete but its folder is missing: kiln serve exits at start."""
    obj = on_procnode(load("smollm2.yaml"), procnode)
    obj["spec"]["storage"] = {"claimName": "empty-cache"}
    apply(plane, ns, obj)
    ie = wait_for("hash", lambda: (lambda x: x if x and x.get("status", {}).get("engineHash") else None)(
        get_ie(admin, ns, "smollm2")), 60)
    h = ie["status"]["engineHash"]
    owner = {"name": "smollm2", "namespace": ns, "uid": ie["metadata"]["uid"]}
    from kiln.operator.spec import parse_spec
    admin.apply(b.engine_record(parse_spec(ie["spec"]), h, owner, "forged", "2026-01-01T00:00:00Z"))
    ie = degraded(admin, ns, "smollm2", "CrashLoopBackOff")
    assert "exit code" in condition(ie, "Degraded")["message"]
    wait_for("a Warning event", lambda: warning_event(admin, ns, "smollm2", "CrashLoopBackOff"), 30)


def test_pod_overrides_and_an_accuracy_gate_reach_children_the_api_server_accepts(plane, admin, ns):
    """spec.pod, env valueFrom / envFrom and build.accuracyGate, admitted by the CRD, rendered
    into a Job and a Deployment the real API server accepts; a Kiln label is refused."""
    from test_builders import POD

    pod = {k: v for k, v in POD.items() if k not in ("priorityClassName", "runtimeClassName")}  # need cluster objects
    pod["affinity"] = {"podAntiAffinity": POD["affinity"]["podAntiAffinity"]}  # no H200 node here
    obj = load("smollm2.yaml", pod=pod, runtime={"env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                                               "envFrom": [{"configMapRef": {"name": "proxy", "optional": True}}]})
    obj["spec"]["build"]["accuracyGate"] = {"maxPerplexityIncrease": 0.05, "minGreedyAgreement": 0.9}
    apply(plane, ns, obj)
    try:
        ie = wait_for("Ready", lambda: ready(admin, ns, "smollm2"), 90)
    except TimeoutError:
        raise AssertionError(json.dumps(get_ie(admin, ns, "smollm2").get("status"), indent=1)) from None
    job = admin.get("batch/v1", "Job", ns, b.job_name("kiln-engine-cache", ie["status"]["engineHash"]))
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-perplexity-increase") + 1] == "0.05" and job["spec"]["podFailurePolicy"]
    assert job["spec"]["template"]["spec"]["affinity"] == pod["affinity"]
    dep = admin.get("apps/v1", "Deployment", ns, "smollm2")
    tpl = dep["spec"]["template"]
    assert tpl["metadata"]["labels"]["team"] == "search" and tpl["spec"]["imagePullSecrets"][0]["name"] == "registry-a"
    assert len(tpl["spec"]["topologySpreadConstraints"]) == 2
    pods = admin.list("v1", "Pod", ns, label_selector=b.selector_string({"name": "smollm2"}))
    assert pods and pods[0]["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    out = plane.kubectl("get", "ie", "smollm2", "-n", ns, "-o", "wide")
    assert "BUILD" in out.splitlines()[0] and "SIZE" in out.splitlines()[0]
    obj["spec"]["pod"] = {"labels": {"kiln.dev/engine": "other"}}
    r = subprocess.run([plane.kubectl_bin, "--kubeconfig", plane.kubeconfig, "apply", "-n", ns, "-f", "-"],
                       input=json.dumps(obj), capture_output=True, text=True)
    assert r.returncode != 0 and "are set by Kiln" in r.stderr, r.stderr


# --- the accuracy gate, run for real on the process node (issue 28: item 8) ------------------------

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def write_tiny_llama(folder: Path) -> None:
    """A 2-layer random Llama (float32, 512-token synthetic tokenizer) as a Hugging Face folder:
    it builds, is measured and serves in seconds on the CPU."""
    import torch
    from safetensors.torch import save_file
    from kiln.runtime.model.config import ModelConfig
    from kiln.runtime.model.llama import LlamaForCausalLM, to_hf_state_dict
    from kiln.runtime.synthetic_tokenizer import synthetic_tokenizer

    folder.mkdir(parents=True)
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(TINY_LLAMA))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data = torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * 0.08
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model).items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    synthetic_tokenizer(TINY_LLAMA["vocab_size"], 1, [2], folder.parent / ".tok-cache").save_pretrained(str(folder))


def claim_folder(admin, ns: str, claim: str) -> Path:
    """The host folder behind a claim once it is bound (the process node's hostPath PVs)."""
    pvc = wait_for(f"claim {claim} bound", lambda: (lambda x: x if x and (x.get("status") or {}).get("phase") == "Bound"
                                                    else None)(admin.get("v1", "PersistentVolumeClaim", ns, claim)), 30)
    pv = admin.request("GET", f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
    return Path(pv["spec"]["hostPath"]["path"])


def complete(pod_ip: str, model: str) -> dict:
    """A greedy completion from a serving pod, straight to its IP (the process node's pod IPs
    are on this machine's loopback interface)."""
    import httpx

    with httpx.Client(trust_env=False, timeout=60) as client:
        r = client.post(f"http://{pod_ip}:{c.HTTP_PORT}/v1/completions", json={
            "model": model, "prompt": "the gate", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_failing_accuracy_gate_degrades_and_the_previous_engine_keeps_serving(plane, admin, ns, procnode):
    """The build Job runs the real ``kiln build`` on the process node: an unquantized engine
    passes its gate (its numbers in the engine record, the manifest and ``status.engine``) and
    serves; an fp8 build of the same random model asked for a greedy agreement of 1 fails its
    gate: Degraded ``AccuracyGateFailed`` with the measured numbers, no record and no folder of
    the new engine, and the Deployment's pod keeps serving the old one."""
    from kiln.common.manifest import read_manifest

    plane.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": ns},
                 "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                          "storageClassName": ""}})
    write_tiny_llama(claim_folder(admin, ns, "models") / "tiny")
    name = "gated"
    obj = on_procnode({"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": name},
                       "spec": {"model": {"pvc": {"claimName": "models", "path": "tiny"}},
                                "build": {"quantization": "none", "maxSeqLen": 512,
                                          "accuracyGate": {"maxPerplexityIncrease": 0.01, "minGreedyAgreement": 0.9,
                                                           "numPrompts": 2}},
                                "runtime": {"maxNumSeqs": 2}, "resources": {"gpus": 0}, "replicas": 1}}, procnode)
    apply(plane, ns, obj)
    try:
        ie = wait_for("Ready", lambda: ready(admin, ns, name), 120)
    except TimeoutError:
        raise AssertionError(json.dumps((get_ie(admin, ns, name) or {}).get("status"), indent=1)) from None
    h1 = ie["status"]["engineHash"]
    record = admin.get("v1", "ConfigMap", ns, b.record_name("kiln-engine-cache", h1))
    acc = json.loads(record["data"]["accuracy"])
    assert acc["numPrompts"] == 2 and acc["greedyAgreement"] >= 0.9 and acc["perplexityIncrease"] <= 0.01, acc
    assert ie["status"]["engine"]["accuracy"] == acc
    cache = claim_folder(admin, ns, "kiln-engine-cache")
    assert read_manifest(cache / h1)["accuracy"] == acc
    pods = admin.list("v1", "Pod", ns, label_selector=b.selector_string({"name": name}))
    assert len(pods) == 1 and pods[0]["status"]["phase"] == "Running", [p.get("status") for p in pods]
    serving_pod = pods[0]
    assert complete(serving_pod["status"]["podIP"], name)["usage"]["completion_tokens"] == 4

    # fp8 of a random model flips greedy tokens: a gate asking for agreement 1 refuses it
    obj["spec"]["build"] = {"quantization": "fp8", "calibrationSamples": 2, "maxSeqLen": 512,
                            "accuracyGate": {"maxPerplexityIncrease": 0, "minGreedyAgreement": 1, "numPrompts": 2}}
    apply(plane, ns, obj)
    ie = degraded(admin, ns, name, "AccuracyGateFailed")
    h2 = ie["status"]["engineHash"]
    assert h2 != h1 and h2 == engine_hash(ie["spec"])
    msg = condition(ie, "Degraded")["message"]
    assert "AccuracyGateFailed: the engine failed its accuracy gate" in msg, msg
    # both bounds fail, each with its measured numbers
    assert "is above the maximum increase of 0.00%" in msg and "perplexity " in msg, msg
    assert "greedy agreement 0." in msg and "over 2 prompts is below the minimum of 1.000" in msg, msg
    assert "teacher-forced top-1 " in msg, msg
    assert ie["status"]["build"]["state"] == "Failed" and "greedy agreement 0." in ie["status"]["build"]["message"]
    job = admin.get("batch/v1", "Job", ns, b.job_name("kiln-engine-cache", h2))
    # exit code 3: the Job's pod failure policy fails it at once (backoffLimit 1 would retry)
    assert job["status"].get("failed") == 1 and any(
        x["type"] == "Failed" and x["reason"] == "PodFailurePolicy" for x in job["status"]["conditions"]), job["status"]
    assert admin.get("v1", "ConfigMap", ns, b.record_name("kiln-engine-cache", h2)) is None
    assert not list(cache.glob(f"*{h2}*"))  # neither the engine nor a temporary folder of it
    assert "engine" not in ie["status"]  # status.engine speaks of the spec's engine, which is not complete
    # the previous engine keeps serving: the Deployment, its pod and the answers are the old ones
    assert deployment_hash(admin, ns, name) == h1 and ie["status"]["servingEngineHash"] == h1
    assert condition(ie, "Available")["status"] == "True"
    pods = admin.list("v1", "Pod", ns, label_selector=b.selector_string({"name": name}))
    assert [p["metadata"]["uid"] for p in pods] == [serving_pod["metadata"]["uid"]]
    assert complete(serving_pod["status"]["podIP"], name)["usage"]["completion_tokens"] == 4
    wait_for("a Warning event", lambda: warning_event(admin, ns, name, "AccuracyGateFailed"), 30)
