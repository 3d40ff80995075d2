"""Operator scale benchmark on the test plane (docs/benchmarks.md, "Operator").

    .venv/bin/python tests/operator/bench_operator.py [--count 200] [--total 500] [--plane dev]

1. N InferenceEngines created at once (16 client threads): time until every one has a status
   (phase and engine hash), until every one also has its Service and the shared build Job
   exists, and until every one has its Deployment (kwok completes the one build Job; its
   success records the shared engine).
2. Grow to TOTAL resources and read the operator process's memory (VmRSS, VmHWM).

The operator's CPU time (user + system, from /proc/<pid>/stat) is read at each step.

The operator runs as a separate process (`kiln operator`, admin credentials, one namespace) so
its memory is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "operator")]

from kiln.devcluster.plane import Plane, gpu_node  # noqa: E402

from kiln.operator.kube import Kube, KubeConfig  # noqa: E402


def ie(name: str, replicas: int) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": name},
            "spec": {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "fp8"},
                     "resources": {"gpus": 0}, "replicas": replicas}}


def create_all(kube: Kube, ns: str, objs: list[dict], threads: int = 16) -> None:
    """POST every object at once (16 client threads), as a GitOps sync of many files would."""
    from concurrent.futures import ThreadPoolExecutor

    def one(o: dict) -> None:
        o["metadata"]["namespace"] = ns
        kube.create(o)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, objs))


def rss_mb(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--total", type=int, default=500)
    p.add_argument("--plane", default=os.environ.get("KILN_PLANE", "dev"))
    p.add_argument("--extra-nodes", type=int, default=2)
    a = p.parse_args()
    plane = Plane(a.plane)
    plane.up()
    plane.kubectl("apply", "--server-side", "-f", str(ROOT / "crds/inferenceengine.yaml"))
    plane.kubectl("wait", "--for=condition=Established", "crd/inferenceengines.kiln.dev")
    plane.apply([gpu_node(f"kwok-bench-{i}", 0) for i in range(a.extra_nodes)])
    ns = f"bench-{int(time.time())}"
    plane.kubectl("create", "namespace", ns)
    plane.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"kiln-cache-{ns}"},
                 "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadWriteOnce"],
                          "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                          "hostPath": {"path": f"/tmp/kiln-pv/{ns}"},
                          "claimRef": {"namespace": ns, "name": "kiln-engine-cache"}}})
    log = open(f"/tmp/kiln-bench-operator-{ns}.log", "w")
    op = subprocess.Popen([sys.executable, "-c", "import sys; from kiln.operator.main import run; sys.exit(run(sys.argv[1:]))",
                           "--kubeconfig", plane.kubeconfig, "--namespace", ns, "--no-leader-election",
                           "--workers", "8", "--resync-seconds", "60", "--log-level", "WARNING"],
                          stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": f"{ROOT}/runtime:{ROOT}/operator"})
    kube = Kube(KubeConfig(kubeconfig=plane.kubeconfig))
    results: dict = {"count": a.count, "total": a.total}
    try:
        time.sleep(3)
        results["rss_idle_mb"] = round(rss_mb(op.pid)[0], 1)
        cpu0 = cpu_s(op.pid)
        results["cpu_start_s"] = round(cpu0, 2)
        names = [f"e{i:04d}" for i in range(a.count)]
        t0 = time.monotonic()
        create_all(kube, ns, [ie(n, 1) for n in names])
        results["create_s"] = round(time.monotonic() - t0, 2)
        status = first = deployed = None
        while time.monotonic() - t0 < 600:
            ies = kube.list("kiln.dev/v1alpha1", "InferenceEngine", ns)
            with_status = {x["metadata"]["name"] for x in ies
                           if (x.get("status") or {}).get("engineHash") and (x.get("status") or {}).get("phase")}
            if status is None and all(n in with_status for n in names):
                status = time.monotonic() - t0
            if status is not None and first is None:
                svcs = {s["metadata"]["name"] for s in kube.list("v1", "Service", ns)}
                jobs = kube.list("batch/v1", "Job", ns)
                deps0 = {d["metadata"]["name"] for d in kube.list("apps/v1", "Deployment", ns)}
                if all(n in svcs for n in names) and (jobs or all(n in deps0 for n in names)):
                    first = time.monotonic() - t0
                    results["build_jobs"] = len(jobs)
            if first is not None:
                deps = {d["metadata"]["name"] for d in kube.list("apps/v1", "Deployment", ns)}
                if all(n in deps for n in names):
                    deployed = time.monotonic() - t0
                    break
            time.sleep(0.5)
        results["all_with_status_s"] = round(status, 1) if status else None
        results["all_first_children_s"] = round(first, 1) if first else None
        results["all_deployments_s"] = round(deployed, 1) if deployed else None
        results["rss_after_count_mb"] = round(rss_mb(op.pid)[0], 1)
        results["cpu_for_count_s"] = round(cpu_s(op.pid) - cpu0, 2)
        # grow to TOTAL (replicas 0: the operator's memory does not depend on pods it never watches)
        more = [f"f{i:04d}" for i in range(a.total - a.count)]
        if more:
            t1 = time.monotonic()
            create_all(kube, ns, [ie(n, 0) for n in more])
            while time.monotonic() - t1 < 600:
                deps = {d["metadata"]["name"] for d in kube.list("apps/v1", "Deployment", ns)}
                if all(n in deps for n in more):
                    break
                time.sleep(1)
            results["grow_to_total_s"] = round(time.monotonic() - t1, 1)
            cpu1 = cpu_s(op.pid)
            time.sleep(65)  # one full resync of every resource
            results["cpu_one_resync_of_total_s"] = round(cpu_s(op.pid) - cpu1, 2)
        rss, hwm = rss_mb(op.pid)
        results["rss_total_mb"] = round(rss, 1)
        results["peak_rss_mb"] = round(hwm, 1)
        results["cpu_total_s"] = round(cpu_s(op.pid) - cpu0, 2)
    finally:
        op.terminate()
        op.wait(30)
        plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        plane.kubectl("delete", "pv", f"kiln-cache-{ns}", "--wait=false", check=False)
        plane.kubectl("delete", "node", *[f"kwok-bench-{i}" for i in range(a.extra_nodes)], "--wait=false", check=False)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
