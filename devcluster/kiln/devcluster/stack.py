"""The whole Kiln stack on the test plane, for the demo (demo.py) and tests/e2e:

    plane (no kwok GPU nodes) + one process-backed node (procnode.py)
    + `helm install` of helm/kiln: the chart's operator Deployment runs its pod on the node,
      authenticated by its projected ServiceAccount token, as on a real cluster
      (``in_cluster=False``: replicaCount=0 and `kiln operator` as a local process with a
      token of the chart's ServiceAccount, so the chart's RBAC still is what it gets)
    + a local proxy per Service (proc_proxy.py) to reach the pods' IPs.

Everything it starts is stopped by ``down()`` (and, for tests, ends with the test process:
procs.py); logs are under the plane folder: ``procnode/<node>/pods/<ns>_<pod>_<uid8>/<container>.log``
(the operator's: ``kiln-system_kiln-*/operator.log``; a local operator's: ``operator.log``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from kiln.devcluster import procs
from kiln.devcluster.paths import REPO, VENV_BIN
from kiln.devcluster.plane import Plane
from kiln.devcluster.proc_proxy import ServiceProxy
from kiln.devcluster.procnode import ProcNode, pod_log_path
from kiln.devcluster.wait import log_lines, log_sizes, wait_for

RELEASE = "kiln"
RELEASE_NS = "kiln-system"
SA = "kiln"  # the chart's ServiceAccount for release "kiln"
OPERATOR_PODS = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
KILN = str(VENV_BIN / "kiln")


def say(msg: str) -> None:
    print(f"[kiln-demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Stack:
    """``detached=False`` (tests): the node runs in this process, the operator as its child;
    ``detached=True`` (the demo): both run as background processes that outlive this one
    (pids in ``<plane>/stack-pids.json``; ``down()`` or ``Stack(name).down()`` stops them).
    ``bind_plane=True``: the plane's processes end with this process too (a test's private plane).
    ``in_cluster=True``: the chart's operator pod runs on the node (``helm_values``: ``--set``
    pairs for the install); False: a local operator process with ``operator_args`` added."""

    def __init__(self, plane_name: str = "demo", node_name: str = "proc-0", operator_args: list[str] | None = None,
                 log: Callable[[str], None] = say, detached: bool = False, bind_plane: bool = False,
                 in_cluster: bool = True, helm_values: dict[str, str] | None = None):
        self.plane = Plane(plane_name, num_gpu_nodes=0, gpus_per_node=4, bind=bind_plane)
        self.node_name = node_name
        self.detached = detached
        self.pids_file = Path(self.plane.dir) / "stack-pids.json"
        self.state_dir = Path(self.plane.dir) / "procnode" / node_name
        self.operator_args = operator_args or []
        self.in_cluster = in_cluster
        self.helm_values = dict(helm_values or {})
        self.log = log
        self.node: ProcNode | None = None
        self.operator: subprocess.Popen | None = None
        self.proxies: list[ServiceProxy] = []
        self._api = None

    # -- bring-up --
    def up(self) -> "Stack":
        t0 = time.monotonic()
        self.log(f"control plane {self.plane.name!r}: building binaries if needed, starting (kiln.devcluster.plane)")
        self.plane.up()
        self.log(f"control plane up ({time.monotonic() - t0:.1f} s): export KUBECONFIG={self.plane.kubeconfig}")
        if self.detached:
            if self._running("procnode") is None:
                self._spawn("procnode", [sys.executable, "-m", "kiln.devcluster.procnode", "run",
                                         "--plane", self.plane.name, "--name", self.node_name],
                            Path(self.plane.dir) / "procnode.log")
            self._wait_node()
        else:
            self.node = ProcNode(self.plane.kubeconfig, self.node_name, gpus=4,
                                 apiserver_port=self.plane.state["ports"]["apiserver"]).start()
        self.log(f"process-backed node {self.node_name} Ready (pod logs: {self.state_dir}/pods/)")
        if self.in_cluster:
            if self.operator_pod(ready=True) is None:
                self.helm_install()
            else:
                self.log("chart installed and operator pod Ready (reused)")
            self.wait_operator()
        elif self._running("operator") is None:
            self.helm_install()
            self.start_operator()
        else:
            self.log("chart installed and operator running (reused)")
        return self

    # -- background processes (detached mode) --
    def _pids(self) -> dict:
        return json.loads(self.pids_file.read_text()) if self.pids_file.exists() else {}

    def _running(self, what: str) -> int | None:
        pid = self._pids().get(what)
        if pid is None:
            return None
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return None
        return pid if str(self.plane.dir) in cmd or f"--plane {self.plane.name} " in cmd + " " else None

    def _spawn(self, what: str, args: list[str], logf: Path) -> subprocess.Popen:
        with open(logf, "ab") as out:  # detached: outlives this process; else ends with it
            p = procs.spawn(args, what=f"stack {self.plane.name}: {what}", bind=not self.detached, stdout=out,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        pids = self._pids()
        pids[what] = p.pid
        self.pids_file.parent.mkdir(parents=True, exist_ok=True)
        self.pids_file.write_text(json.dumps(pids))
        return p

    def _wait_node(self, stall: float = 60) -> None:
        def ready() -> bool:
            out = self.kubectl("get", "node", self.node_name, "-o", "json", "--ignore-not-found")
            return bool(out.strip()) and any(c["type"] == "Ready" and c["status"] == "True"
                                             for c in json.loads(out)["status"].get("conditions") or [])

        try:
            wait_for(f"node {self.node_name} Ready", ready, stall=stall,
                     progress=lambda: log_sizes(self.plane.dir, "procnode.log"), check_every=2)
        except TimeoutError as e:
            raise TimeoutError(f"{e} (log {self.plane.dir}/procnode.log)") from None

    @property
    def api(self):
        if self._api is None:
            from kubernetes import client, config
            self._api = client.CoreV1Api(config.new_client_from_config(config_file=self.plane.kubeconfig))
        return self._api

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return self.plane.kubectl(*args, input=input, check=check)

    def helm_install(self) -> None:
        """`helm upgrade --install` of helm/kiln; in-cluster it returns once the objects exist
        (``wait_operator`` waits for the pod, giving up on a stall rather than a deadline)."""
        values = dict(self.helm_values) if self.in_cluster else {**self.helm_values, "replicaCount": "0"}
        sets = [x for k, v in values.items() for x in ("--set", f"{k}={v}")]
        where = "the operator runs in the cluster" if self.in_cluster else "the operator runs locally: replicaCount=0"
        self.log(f"helm install kiln helm/kiln -n {RELEASE_NS} {' '.join(sets)} ({where})".replace("  ", " "))
        wait = [] if self.in_cluster else ["--wait", "--timeout", "120s"]
        r = subprocess.run([self.plane.helm_bin, "upgrade", "--install", RELEASE, str(REPO / "helm" / "kiln"),
                            "--namespace", RELEASE_NS, "--create-namespace", "--kubeconfig", self.plane.kubeconfig,
                            *sets, *wait], capture_output=True, text=True, env=self.plane.env(), timeout=180)
        if r.returncode != 0:
            raise RuntimeError(f"helm install failed:\n{r.stdout}\n{r.stderr}")
        self.kubectl("wait", "--for=condition=Established", "crd/inferenceengines.kiln.dev", "--timeout=60s")

    def operator_pod(self, ready: bool = False) -> dict | None:
        """The chart's operator pod on this plane (the newest; only a Ready one with ``ready``)."""
        out = self.kubectl("get", "pods", "-n", RELEASE_NS, "-l", OPERATOR_PODS, "-o", "json", check=False)
        pods = json.loads(out)["items"] if out.strip().startswith("{") else []
        pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")
                and (not ready or self._pod_state(p) == "Running/Ready")]
        return max(pods, key=lambda p: p["metadata"]["creationTimestamp"]) if pods else None

    def wait_operator(self, stall: float = 120) -> dict:
        """Waits until the operator pod is Ready and holds the leader Lease; returns the pod."""
        def leading() -> dict | None:
            pod = self.operator_pod(ready=True)
            if pod is None:
                return None
            lease = self.kubectl("get", "lease", RELEASE, "-n", RELEASE_NS, "-o",
                                 "jsonpath={.spec.holderIdentity}", "--ignore-not-found", check=False)
            return pod if lease.strip() == pod["metadata"]["name"] else None

        try:
            pod = self.wait_for("the operator pod Ready and leading", leading, stall=stall, ns=RELEASE_NS)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.operator_log_tail()}") from None
        self.log(f"operator pod {RELEASE_NS}/{pod['metadata']['name']} Ready and leading, as ServiceAccount "
                 f"{RELEASE_NS}/{pod['spec'].get('serviceAccountName')} (log {self.operator_log()})")
        return pod

    def operator_log(self) -> Path | None:
        """The operator's log file: its pod's container log in-cluster, else operator.log."""
        if not self.in_cluster:
            return Path(self.plane.dir) / "operator.log"
        found = sorted(self.state_dir.glob(f"pods/{RELEASE_NS}_{RELEASE}-*/operator.log"),
                       key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    def operator_log_tail(self, tail: int = 3000) -> str:
        op = self.operator_log()
        if op is None or not op.exists():
            return "(no operator log)"
        return f"--- {op}\n{op.read_text(errors='replace')[-tail:]}"

    def sa_kubeconfig(self) -> str:
        """A kubeconfig with the chart ServiceAccount's token (what the operator pod would get)."""
        import yaml
        token = self.kubectl("create", "token", SA, "-n", RELEASE_NS, "--duration=24h").strip()
        path = Path(self.plane.dir) / "operator-sa.kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": [{"name": "plane", "cluster": {"server": self.plane.server,
                                                        "certificate-authority": str(self.plane.pki / "ca.crt")}}],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": "plane", "user": "sa"}}]}))
        return str(path)

    def start_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            return
        logf = Path(self.plane.dir) / "operator.log"
        kc = self.sa_kubeconfig()
        # The chart's command: `kiln operator ...` (the runtime image's entry point).
        args = [KILN, "operator", "--kubeconfig", kc, "--all-namespaces",
                "--lease-namespace", RELEASE_NS, "--lease-name", RELEASE, "--identity", "local-operator",
                "--resync-seconds", "10", "--autoscale-seconds", "3", *self.operator_args]
        self.operator = self._spawn("operator", args, logf)
        self.log(f"kiln operator started as ServiceAccount {RELEASE_NS}/{SA} (pid {self.operator.pid}, log {logf})")

    def stop_operator(self) -> None:
        self._stop_pid("operator", 15)
        self.operator = None

    def _stop_pid(self, what: str, grace: float) -> None:
        pid = self._running(what)
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._running(what) == pid:
            if self.operator is not None and what == "operator":
                self.operator.poll()  # reap our child
            time.sleep(0.2)
        if self._running(what) == pid:
            os.kill(pid, signal.SIGKILL)
        procs.forget(pid)
        pids = self._pids()
        pids.pop(what, None)
        if self.pids_file.parent.exists():
            self.pids_file.write_text(json.dumps(pids))

    def down(self, keep_plane: bool = False, remove: bool = False) -> None:
        for p in self.proxies:
            p.stop()
        self.proxies.clear()
        self.stop_operator()
        if self.node is not None:
            self.node.stop(delete_node=keep_plane)
            self.node = None
        self._stop_pid("procnode", 40)
        if not keep_plane:
            self.plane.down(remove=remove)
            # A restarted plane has a fresh etcd (no claims, no engine records): the node's
            # volume folders could never be reused, so they go with it.
            shutil.rmtree(self.state_dir.parent / "volumes", ignore_errors=True)

    # -- resources --
    def ensure_namespace(self, ns: str) -> None:
        if not self.kubectl("get", "namespace", ns, "--ignore-not-found"):
            self.kubectl("create", "namespace", ns)

    def apply_file(self, path: str | Path, ns: str) -> None:
        self.kubectl("apply", "-n", ns, "-f", str(path))

    def apply_obj(self, obj: dict, ns: str) -> None:
        self.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))

    def engine(self, name: str, ns: str) -> dict | None:
        out = self.kubectl("get", "inferenceengine", name, "-n", ns, "-o", "json", "--ignore-not-found")
        return json.loads(out) if out.strip() else None

    def pods(self, ns: str, selector: str = "") -> list[dict]:
        args = ["get", "pods", "-n", ns, "-o", "json"] + (["-l", selector] if selector else [])
        return json.loads(self.kubectl(*args))["items"]

    def wait_ready(self, name: str, ns: str, stall: float = 600, generation: int | None = None,
                   progress: bool = True) -> float:
        """Waits until the engine's phase is Ready (for ``generation`` or later); prints each
        change of phase, build state and progress (``status.build.progress``), replicas and pods.  Fails when it turns Degraded, or when
        for ``stall`` seconds neither that view nor its pods' logs (build output, server start-up;
        not probe access lines) changed: a loaded machine makes it slower, not failed.  Returns
        the seconds waited."""
        t0 = time.monotonic()
        last: list = [None]

        def ready() -> bool:
            ie = self.engine(name, ns) or {}
            st = ie.get("status") or {}
            pods = self.pods(ns, f"kiln.dev/engine={name}")
            podsum = ", ".join(sorted(f"{p['metadata']['name']}:{self._pod_state(p)}" for p in pods)) or "-"
            build = st.get("build") or {}
            view = (st.get("phase"), build.get("state"), st.get("readyReplicas"), podsum,
                    st.get("observedGeneration"), build.get("progress"))
            if view != last[0]:
                if progress:  # the build's own progress (status.build.progress) while it runs
                    where = f" ({view[5]})" if view[5] else ""
                    self.log(f"  +{time.monotonic() - t0:5.1f}s  phase={view[0]} build={view[1]}{where} "
                             f"ready={view[2]} pods=[{podsum}]")
                last[0] = view
            gen_ok = generation is None or int(st.get("observedGeneration") or 0) >= generation
            if st.get("phase") == "Degraded":
                raise RuntimeError(f"{ns}/{name} is Degraded: {json.dumps(st.get('conditions'), indent=1)}\n"
                                   + self.failure_logs(ns, name))
            return st.get("phase") == "Ready" and gen_ok

        try:
            wait_for(f"{ns}/{name} Ready", ready, stall=stall, interval=1, check_every=1,
                     progress=lambda: (last[0], log_lines(self.state_dir / "pods", f"{ns}_*/*.log")))
        except TimeoutError as e:
            raise TimeoutError(f"{ns}/{name} not Ready: {e}\n" + self.failure_logs(ns, name)) from None
        return time.monotonic() - t0

    def wait_for(self, what: str, fn, stall: float = 60, interval: float = 0.5, ns: str | None = None):
        """wait.wait_for, counting this stack's progress (objects of ns, or of all namespaces, and
        pod logs): fn's truthy answer, or TimeoutError after stall seconds without a change."""
        return wait_for(what, fn, stall=stall, interval=interval, progress=lambda: self.progress(ns))

    def progress(self, ns: str | None = None) -> tuple:
        """What changes while the stack's workloads advance: the plane's objects (of ns, or all)
        and the process node's pod logs (not probe access lines): wait_for's progress probe."""
        return self.plane.progress(ns), log_lines(self.state_dir / "pods", f"{ns or '*'}_*/*.log")

    @staticmethod
    def _pod_state(p: dict) -> str:
        st = p.get("status") or {}
        if p["metadata"].get("deletionTimestamp"):
            return "Terminating"
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
        return st.get("phase", "?") + ("/Ready" if ready else "")

    def failure_logs(self, ns: str, name: str, tail: int = 3000) -> str:
        out = []
        for p in self.pods(ns, f"kiln.dev/engine={name}"):
            path = pod_log_path(self.state_dir, ns, p["metadata"]["name"])
            if path is not None:
                out.append(f"--- {path}\n{path.read_text(errors='replace')[-tail:]}")
        out.append(self.operator_log_tail(tail))
        return "\n".join(out)

    def proxy(self, service: str, ns: str) -> ServiceProxy:
        p = ServiceProxy(self.api, ns, service).start()
        self.proxies.append(p)
        return p
