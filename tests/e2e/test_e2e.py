"""End to end on real input: `kubectl apply` an InferenceEngine on the test plane with a
process-backed node; the build Job really runs `kiln build`, the pods really run `kiln serve`,
probes are real, requests go through the Service's ready endpoints (kiln.devcluster.proc_proxy).

    .venv/bin/python -m pytest -m e2e tests/e2e -s     # ~10 min on 2 cores

Waits give up when nothing advances (kiln.devcluster.wait), not on a clock: ``stall`` is the
longest quiet time of the awaited thing, and a loaded machine only makes a test slower.

Numbers (apply->Ready uncached/cached, failed requests during a rollout, scale-up reaction)
are printed and appended to <plane>/e2e-measurements.jsonl.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from kiln.devcluster.fixtures import skip_or_fail_in_ci
from kiln.devcluster.load import ClientLoop, Load, chat

# The timeout is a hang guard only (the waits fail on a stall): sized for a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2.yaml"
QUESTION = "What is the capital of France?"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def jobs(stack, ns, name):
    """The build Jobs in the test's namespace (shared per engine, so not labelled with ``name``)."""
    return json.loads(stack.kubectl("get", "jobs", "-n", ns, "-l", "app.kubernetes.io/component=build",
                                    "-o", "json"))["items"]


def server_pods(stack, ns, name):
    return [p for p in stack.pods(ns, f"kiln.dev/engine={name},app.kubernetes.io/component=server")
            if not p["metadata"].get("deletionTimestamp")]


def replicas(stack, ns, name) -> tuple[int, int]:
    d = json.loads(stack.kubectl("get", "deployment", name, "-n", ns, "-o", "json"))
    return int(d["spec"].get("replicas") or 0), int((d.get("status") or {}).get("readyReplicas") or 0)


def operator_in_cluster(stack) -> dict:
    """The chart's operator pod, asserted to be what acts: Ready on the process node, holding
    the leader Lease, authenticated by its projected ServiceAccount token; no local operator."""
    pod = stack.operator_pod(ready=True)
    assert pod is not None and pod["spec"]["nodeName"] == stack.node_name
    assert stack.operator is None and not (Path(stack.plane.dir) / "operator.log").exists()
    holder = stack.kubectl("get", "lease", "kiln", "-n", "kiln-system", "-o", "jsonpath={.spec.holderIdentity}")
    assert holder == pod["metadata"]["name"]
    mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts
    return pod


# --- (a) + (c): apply -> Ready -> answer; delete -> children gone, engine cached; re-apply ----

class BuildWatch:
    """While a build runs: what ``kubectl get inferenceengine`` shows (the JSON's
    ``status.build`` and the default table's Build printer column) every ``period`` seconds,
    and the lines the stack logs meanwhile (``Stack.wait_ready``'s, which ``make demo`` prints)."""

    def __init__(self, stack, ns: str, name: str, period: float = 1.0):
        self.stack, self.ns, self.name, self.period = stack, ns, name, period
        self.builds: list[dict] = []  # status.build of each look while its state was Running
        self.columns: list[str] = []  # the Build column of each look (table), non-empty ones
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._log = stack.log

    def __enter__(self):
        self.stack.log = lambda m: (self.lines.append(m), self._log(m))
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)
        self.stack.log = self._log

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            ie = self.stack.engine(self.name, self.ns) or {}
            build = (ie.get("status") or {}).get("build") or {}
            if build.get("state") == "Running":
                self.builds.append(build)
            table = self.stack.kubectl("get", "inferenceengine", self.name, "-n", self.ns, check=False)
            rows = [line.split("  ") for line in table.splitlines()]
            if len(rows) == 2:  # header and the engine's row: columns are separated by 2+ spaces
                header = [h.strip() for h in rows[0] if h.strip()]
                row = [v.strip() for v in rows[1] if v.strip()]
                if "BUILD" in header and len(row) == len(header):
                    self.columns.append(row[header.index("BUILD")])


def test_apply_ready_answer_delete_reapply(stack, ns, measure):
    """examples/smollm2.yaml through the operator that a default `helm install` runs in the cluster.
    While its build runs, status.build shows the build's progress (read from the build pod's log
    every 2 s: operator.buildProgressSeconds of the e2e install), `kubectl get inferenceengine`
    shows it in the Build column, and Stack.wait_ready (what `make demo` prints while it waits)
    prints it."""
    from kiln.common.progress import STAGES
    ie = example()
    name = ie["metadata"]["name"]
    pod = operator_in_cluster(stack)
    t0 = time.monotonic()
    stack.apply_file(EXAMPLE, ns)
    with BuildWatch(stack, ns, name) as watch:
        uncached = stack.wait_ready(name, ns)
    measure("apply -> Ready, engine uncached", uncached, quantization=ie["spec"]["build"]["quantization"])
    progress = [b["progress"] for b in watch.builds if b.get("progress")]
    seen = list(dict.fromkeys(progress))  # distinct, in order
    measure("build progress values seen while the build ran", len(seen), unit="values", values=seen)
    assert len(seen) >= 2, f"status.build.progress did not change while the build ran: {watch.builds}"
    last = next(b for b in reversed(watch.builds) if b.get("progress"))
    assert last["stage"] in STAGES and last["elapsedSeconds"] >= 0 and last["progress"].startswith(last["stage"])
    assert all(0 < b["layer"] <= b["numLayers"] == 30 for b in watch.builds if "layer" in b), watch.builds
    assert set(watch.columns) & set(seen), (watch.columns, seen)  # the printer column shows the same text
    printed = [line for line in watch.lines if "build=Running (" in line]
    assert any(f"({p})" in line for p in seen for line in printed), printed  # what the demo prints
    assert f"{ns}/{name}" in stack.operator_log().read_text()  # the in-cluster operator did it
    assert operator_in_cluster(stack)["metadata"]["uid"] == pod["metadata"]["uid"]  # the same pod throughout
    st = stack.engine(name, ns)["status"]
    assert st["build"]["state"] == "Succeeded"
    h = st["engineHash"]
    assert len(jobs(stack, ns, name)) == 1

    proxy = stack.proxy(name, ns)
    proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))
    answer = chat(proxy.url, QUESTION, max_tokens=48, model=name)
    print(f"[e2e] Q: {QUESTION}\n[e2e] A: {answer}")
    assert "paris" in answer.lower(), answer
    measure("apply -> first answer (uncached)", time.monotonic() - t0)
    # the serving pods keep Triton's kernel cache on the engine claim (runtime.compileCache)
    ctr = json.loads(stack.kubectl("get", "deployment", name, "-n", ns, "-o", "json"))["spec"]["template"]["spec"][
        "containers"][0]
    assert {"name": "TRITON_CACHE_DIR", "value": "/var/cache/kiln/triton"} in ctr["env"], ctr["env"]
    assert any(m.get("subPath") == ".compile-cache" and not m.get("readOnly") for m in ctr["volumeMounts"])

    # Deleting the resource removes its pods and jobs; the engine (claim, record, files) stays.
    stack.kubectl("delete", "inferenceengine", name, "-n", ns, "--wait=true", "--timeout=120s")
    stack.wait_for("pods and jobs gone", lambda: not stack.pods(ns) and not jobs(stack, ns, name), stall=120, ns=ns)
    assert stack.kubectl("get", "pvc", "kiln-engine-cache", "-n", ns, "--ignore-not-found").strip()
    records = json.loads(stack.kubectl("get", "configmaps", "-n", ns, "-l", f"kiln.dev/engine-hash={h}",
                                       "-o", "json"))["items"]
    assert records, "the engine record went away with the resource"
    engine_dirs = list((stack.state_dir.parent / "volumes").glob(f"{ns}_kiln-engine-cache_*/{h}"))
    assert engine_dirs and (engine_dirs[0] / "manifest.json").exists(), "the engine files went away"
    # kiln serve found TRITON_CACHE_DIR writable on the claim and created it there
    assert (engine_dirs[0].parent / ".compile-cache" / "triton").is_dir()

    # Re-applying reuses the engine: no build Job, Ready faster.
    stack.apply_file(EXAMPLE, ns)
    cached = stack.wait_ready(name, ns)
    measure("apply -> Ready, engine cached", cached)
    st = stack.engine(name, ns)["status"]
    assert st["build"]["state"] == "Cached" and st["engineHash"] == h
    assert not jobs(stack, ns, name), "a cached engine must not be rebuilt"
    proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))
    assert "paris" in chat(proxy.url, QUESTION, max_tokens=48, model=name).lower()


# --- (d): spec change -> new engine -> rolling update with a client loop running ------------

def test_spec_change_rolls_out_without_failed_requests(stack, ns, measure):
    """A build field changes: a new engine hash, a new build, a rolling update under a client loop.
    Both engines are unquantized (no calibration), so the test's time is the rollout's."""
    ie = example()
    ie["spec"]["build"] = {"quantization": "none", "maxSeqLen": 2048}
    name = ie["metadata"]["name"]
    stack.apply_obj(ie, ns)
    stack.wait_ready(name, ns)
    old_hash = stack.engine(name, ns)["status"]["engineHash"]
    old_pods = {p["metadata"]["name"] for p in server_pods(stack, ns, name)}
    proxy = stack.proxy(name, ns)
    proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))

    loop = ClientLoop(proxy.url, model=name).start()
    time.sleep(3)
    new = copy.deepcopy(ie)
    new["spec"]["build"]["maxSeqLen"] = 1024  # another build: a new engine hash
    t0 = time.monotonic()
    stack.apply_obj(new, ns)
    gen = int(stack.engine(name, ns)["metadata"]["generation"])
    stack.wait_for("a new engine hash", lambda: stack.engine(name, ns)["status"].get("engineHash") != old_hash, 60, ns=ns)
    new_hash = stack.engine(name, ns)["status"]["engineHash"]
    stack.wait_ready(name, ns, generation=gen)

    def rolled():
        pods = server_pods(stack, ns, name)
        return pods and all(p["metadata"]["labels"].get("kiln.dev/engine-hash") == new_hash for p in pods) \
            and not (old_pods & {p["metadata"]["name"] for p in stack.pods(ns)})
    stack.wait_for("old pods gone", rolled, stall=300, ns=ns)
    rollout_s = time.monotonic() - t0
    time.sleep(3)
    loop.stop()
    measure("spec change -> rolled out", rollout_s)
    measure("requests during rollout", loop.num_ok + loop.num_failed, unit="requests", failed=loop.num_failed,
            proxy_connect_retries=proxy.num_connect_retries)
    assert {j["metadata"]["labels"]["kiln.dev/engine-hash"] for j in jobs(stack, ns, name)} >= {old_hash, new_hash}
    assert loop.num_ok > 0
    assert loop.num_failed == 0, loop.errors[:10]


# --- (e): queue latency drives the autoscaler ---------------------------------------------------

def _autoscaled(mode: str) -> dict:
    ie = example()
    ie["metadata"]["name"] = f"smollm2-{mode}"
    ie["spec"]["runtime"] = {"maxNumSeqs": 2}  # few slots: concurrent load queues
    ie["spec"]["build"] = {"quantization": "none", "maxSeqLen": 2048}  # no calibration: the signal is the point
    ie["spec"].pop("replicas", None)
    ie["spec"]["autoscaling"] = {"mode": mode, "minReplicas": 1, "maxReplicas": 2, "targetQueueTimeSeconds": 0.2,
                                 "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 15}
    return ie


def _scale_cycle(stack, ns, name, measure, mode: str) -> None:
    proxy = stack.proxy(name, ns)
    proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))
    assert replicas(stack, ns, name)[0] == 1
    load = Load(proxy.url, concurrency=10, max_tokens=48, model=name).start()
    t0 = time.monotonic()
    try:
        stack.wait_for("scale-up to 2 replicas", lambda: replicas(stack, ns, name)[0] >= 2, stall=300, ns=ns)
        measure(f"scale-up reaction ({mode}): load start -> 2 replicas desired", time.monotonic() - t0)
        stack.wait_for("2 ready replicas", lambda: replicas(stack, ns, name)[1] >= 2, stall=300, ns=ns)
        measure(f"scale-up ({mode}): load start -> 2 replicas ready", time.monotonic() - t0)
    finally:
        load.stop()
    t1 = time.monotonic()
    stack.wait_for("scale-down to 1 replica", lambda: replicas(stack, ns, name)[0] == 1, stall=300, interval=1, ns=ns)
    measure(f"scale-down ({mode}): load stop -> 1 replica", time.monotonic() - t1, load_ok=load.num_ok,
            load_failed=load.num_failed)


def test_builtin_autoscaler_scales_on_queue_time(stack, ns, measure):
    ie = _autoscaled("builtin")
    name = ie["metadata"]["name"]
    stack.apply_obj(ie, ns)
    stack.wait_ready(name, ns)
    _scale_cycle(stack, ns, name, measure, "builtin")


def test_hpa_scales_through_real_prometheus_and_prometheus_adapter(stack, ns, measure, tmp_path):
    """Mode hpa end to end: Prometheus (Debian package) scrapes the serving pods, prometheus-adapter
    (built from source) serves kiln_request_queue_time_seconds with the chart's rule and PromQL
    through the aggregator, and the HPA scales the engine up under load and back down."""
    from kiln.devcluster.monitoring import (Prometheus, PrometheusAdapter, adapter_bin, chart_adapter_rules,
                                            prometheus_bin)
    prom_bin, ad_bin = prometheus_bin(), adapter_bin()
    if prom_bin is None:
        skip_or_fail_in_ci("no prometheus binary: apt-get install prometheus (.ci/run installs it)")
    if ad_bin is None:
        skip_or_fail_in_ci("no prometheus-adapter: bash devcluster/build.sh prometheus-adapter (make metrics-build)")
    plane = stack.plane
    # a window of several scheduling events: on a loaded 2-core machine a request of this test takes
    # tens of seconds, and a window with none reads 0 (the HPA then scales down a pod still loading)
    rules = chart_adapter_rules(plane.helm_bin, "60s")
    prom = Prometheus(plane, tmp_path / "prometheus")
    adapter = PrometheusAdapter(plane, tmp_path / "adapter", prom.url, rules)
    try:
        prom.start(prom_bin)
        stack.wait_for("Prometheus ready", prom.ready, stall=60)
        adapter.start(ad_bin)
        adapter.use()
        stack.wait_for("prometheus-adapter's APIService Available", adapter.available, stall=90)
        ie = _autoscaled("hpa")
        name = ie["metadata"]["name"]
        stack.apply_obj(ie, ns)
        stack.wait_ready(name, ns)
        stack.wait_for("the HPA", lambda: stack.kubectl("get", "hpa", name, "-n", ns, "--ignore-not-found").strip(),
                       60, ns=ns)
        stack.wait_for("Prometheus scraping the pod", lambda: prom.query(
            f'kiln_request_queue_time_seconds_count{{namespace="{ns}"}}'), stall=120, ns=ns)
        stack.wait_for("the custom metrics API serving the pod's queue time",
                       lambda: adapter.pods_metric(ns, "kiln_request_queue_time_seconds"), stall=120, ns=ns)
        _scale_cycle(stack, ns, name, measure, "hpa, Prometheus + prometheus-adapter")
        hpa = json.loads(stack.kubectl("get", "hpa", name, "-n", ns, "-o", "json"))
        current = hpa["status"]["currentMetrics"][0]["pods"]
        assert current["metric"]["name"] == "kiln_request_queue_time_seconds"
    finally:
        adapter.restore()
        adapter.stop()
        prom.stop()
