"""The test Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok run as plain processes from the binaries that build.sh caches, plus a
custom-metrics API server that tests feed.

    python -m kiln.devcluster.plane up [--name dev] [--gpu-nodes 2] [--gpus-per-node 4]
    python -m kiln.devcluster.plane status|env|down [--name dev]

Each plane lives in its own folder (${KILN_PLANE_HOME:-~/.cache/kiln/cluster/planes}/<name>/:
state.json, kubeconfig, pki/, logs/, etcd data) on free ports, so a test run's plane ("pytest")
and a developer's ("dev") run side by side. Stdlib only: it runs under any python3 with
`devcluster/` on PYTHONPATH (what devcluster/cluster.mk does when there is no .venv).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kiln.devcluster import pki, procs
from kiln.devcluster.custom_metrics import CustomMetrics
from kiln.devcluster.paths import BUILD_SH
from kiln.devcluster.wait import log_sizes, objects_state, wait_for

PLANES_HOME = Path(os.environ.get("KILN_PLANE_HOME", Path.home() / ".cache/kiln/cluster/planes"))
ADVERTISE_ADDRESS = "127.0.0.1"  # the machine has no default route, so the apiserver cannot pick one
KWOK_NODE_LABEL = "kiln.dev/node-kind"  # kwok manages nodes with KWOK_NODE_LABEL=kwok, and no others
POD_CIDR = "10.244.0.0/16"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "custom-metrics")


def log(msg: str) -> None:
    print(f"[plane {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bin_dir(build: bool = True) -> Path:
    """The cached binaries' folder; runs build.sh (minutes the first time) when build is true.
    The build is this process's child (a process group bound to it): interrupting this process
    stops the build too (build.sh resumes where it stopped on the next call)."""
    r = subprocess.run(["bash", str(BUILD_SH), "--print"], capture_output=True, text=True)
    if r.returncode == 0:
        return Path(r.stdout.strip().splitlines()[-1])
    if not build:
        raise FileNotFoundError("control-plane binaries are not built: run `make cluster-build`")
    log(f"binaries missing: building them ({BUILD_SH})")
    p = procs.spawn(["bash", str(BUILD_SH)], what="build.sh", bind=True, stdout=subprocess.PIPE)
    try:
        out, _ = p.communicate()
    except BaseException:
        procs.stop_group(p.pid, grace=10)
        p.wait()
        raise
    procs.forget(p.pid)
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, ["bash", str(BUILD_SH)], out)
    return Path(out.decode().strip().splitlines()[-1])


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held together while picked, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _alive(pid: int, marker: str) -> bool:
    """True if pid runs and its command line names marker (this plane's folder): a reused pid
    of some other process is never taken for ours."""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False


@dataclass
class Plane:
    """One control plane. `up()` starts it, `down()` stops it; the rest are helpers for tests."""

    name: str = "dev"
    num_gpu_nodes: int = 2  # kwok nodes, each with gpus_per_node nvidia.com/gpu
    gpus_per_node: int = 4
    home: Path = field(default_factory=lambda: PLANES_HOME)
    bin: Path | None = None
    state: dict = field(default_factory=dict)
    # True: the processes that up() starts end with this process (a test run's plane; see
    # procs.py); False: they outlive it until down() (`make cluster-up`).
    bind: bool = False

    def __post_init__(self) -> None:
        self.dir = Path(self.home) / self.name
        self.pki = self.dir / "pki"
        self.logs = self.dir / "logs"
        self.kubeconfig = str(self.dir / "kubeconfig")
        self._procs: dict[str, subprocess.Popen] = {}  # the ones this object started
        self._load_state()

    # -- paths and helpers -------------------------------------------------------------------
    def _load_state(self) -> None:
        f = self.dir / "state.json"
        self.state = json.loads(f.read_text()) if f.exists() else {}
        if self.bin is None and self.state.get("bin"):
            self.bin = Path(self.state["bin"])

    def _bins(self) -> Path:
        if self.bin is None:
            self.bin = bin_dir()
        return self.bin

    @property
    def kubectl_bin(self) -> str:
        return str(self._bins() / "kubectl")

    @property
    def helm_bin(self) -> str:
        return str(self._bins() / "helm")

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.state['ports']['apiserver']}"

    @property
    def custom_metrics(self) -> CustomMetrics:
        return CustomMetrics(f"https://127.0.0.1:{self.state['ports']['custom_metrics']}", str(self.pki / "ca.crt"))

    def env(self) -> dict[str, str]:
        """os.environ with KUBECONFIG set to this plane, for subprocesses (kubectl, helm, kopf)."""
        return {**os.environ, "KUBECONFIG": self.kubeconfig}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        """Runs kubectl against this plane and returns its stdout; raises with stderr on failure."""
        r = subprocess.run([self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args], input=input,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def apply(self, obj: dict | list) -> str:
        """kubectl apply of one object or a list of them (dicts)."""
        items = obj if isinstance(obj, list) else [obj]
        return self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

    def progress(self, namespace: str | None = None) -> tuple:
        """What changes while workloads on the plane advance (pods, Jobs, Deployments, HPAs,
        InferenceEngines of namespace, or of all): the progress probe of wait.wait_for."""
        scope = ["-n", namespace] if namespace else ["-A"]
        items: list[dict] = []
        for kinds in ("pods,jobs.batch,deployments.apps,horizontalpodautoscalers.autoscaling",
                      "inferenceengines.kiln.dev"):  # apart: the CRD may not be installed
            try:
                out = self.kubectl("get", kinds, *scope, "-o", "json", check=False)
                items += json.loads(out or '{"items": []}').get("items", [])
            except (ValueError, subprocess.TimeoutExpired):
                pass
        return objects_state(items)

    def add_node(self, name: str, gpus: int, kind: str = "kwok", labels: dict[str, str] | None = None,
                 taints: list[dict] | None = None) -> None:
        """Adds a node with gpus nvidia.com/gpu. kind "kwok" is run by kwok; any other kind (e.g.
        "process") is left to whatever agent registers as that node."""
        node = gpu_node(name, gpus, {KWOK_NODE_LABEL: kind, **(labels or {})})
        if taints:
            node["spec"]["taints"] = taints
        self.apply(node)

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def _get(self, url: str, ctx: ssl.SSLContext | None = None) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=3) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (OSError, ssl.SSLError) as e:
            return 0, str(e)

    # -- lifecycle -----------------------------------------------------------------------------
    def pids(self) -> dict[str, int]:
        """Running processes of this plane, by component."""
        marker = str(self.dir) + "/"
        return {c: p for c, p in self.state.get("pids", {}).items() if _alive(p, marker)}

    def is_healthy(self) -> bool:
        if not self.state.get("ready") or len(self.pids()) != len(COMPONENTS):
            return False
        code, _ = self._get(self.server + "/readyz", self._ssl())
        return code == 200

    def _spawn(self, name: str, args: list[str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "wb") as out:  # this start's log only
            # An orphaned kube-apiserver can take minutes to stop on SIGTERM, and an orphaned
            # plane's data is thrown away anyway (reap_stale): SIGKILL.
            p = procs.spawn(args, what=f"plane {self.name}: {name}", bind=self.bind, stdout=out,
                            stderr=subprocess.STDOUT, cwd=self.dir, death_signal=signal.SIGKILL)
        self._procs[name] = p
        self.state.setdefault("pids", {})[name] = p.pid
        self._save()

    def _save(self) -> None:
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        tmp.rename(self.dir / "state.json")

    def _wait(self, what: str, ok, stall: float = 60, component: str | None = None) -> None:
        """Waits until ok(); fails when component exits, or when for stall seconds neither ok()
        nor the plane's logs changed (a loaded machine starts slowly, but its logs grow)."""
        def check():
            proc = self._procs.get(component or "")
            if proc is not None and proc.poll() is not None:
                tail = (self.logs / f"{component}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{component} exited while waiting for {what}:\n{tail}")
            return ok()

        try:
            wait_for(what, check, stall=stall, interval=0.2, progress=lambda: log_sizes(self.logs), check_every=2)
        except TimeoutError as e:
            raise TimeoutError(f"{e} (logs: {self.logs})") from None

    def up(self) -> "Plane":
        """Starts the plane (reusing one that already runs healthy) and waits until it is ready."""
        if self.is_healthy():
            self.num_gpu_nodes = self.state.get("num_gpu_nodes", self.num_gpu_nodes)
            self.gpus_per_node = self.state.get("gpus_per_node", self.gpus_per_node)
            log(f"plane {self.name!r} already up")
            return self
        self.down(quiet=True)
        try:
            self._up()
        except BaseException:
            log(f"plane {self.name!r} failed to start; logs in {self.logs}")
            self.down(quiet=True)
            raise
        return self

    def _up(self) -> None:
        t0 = time.monotonic()
        b = self._bins()
        self.dir.mkdir(parents=True, exist_ok=True)
        pki.ensure_pki(self.pki, ADVERTISE_ADDRESS)
        names = ["etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok", "custom_metrics"]
        ports = dict(zip(names, free_ports(len(names))))
        self.state = {"name": self.name, "bin": str(b), "ports": ports, "pids": {}, "ready": False,
                      "num_gpu_nodes": self.num_gpu_nodes, "gpus_per_node": self.gpus_per_node}
        self._save()
        P = self.pki
        for user in pki.CLIENTS:
            pki.write_kubeconfig(self.dir / f"{user}.kubeconfig", P, self.server, user)
        pki.write_kubeconfig(self.dir / "kubeconfig", P, self.server, "admin")
        # A plane is fresh every time: down() removes the etcd data folder.
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer = f"http://127.0.0.1:{ports['etcd_peer']}"
        self._spawn("etcd", [
            str(b / "etcd"), "--name=plane", f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=plane={peer}", "--unsafe-no-fsync", "--log-level=warn"])
        self._wait("etcd", lambda: self._get(etcd_url + "/health")[0] == 200, 30, "etcd")
        self._spawn("kube-apiserver", [
            str(b / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", f"--advertise-address={ADVERTISE_ADDRESS}",
            # The API server's own Endpoints may not be loopback; nothing in a pod dials it here.
            "--endpoint-reconciler-type=none",
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={P / 'apiserver.crt'}", f"--tls-private-key-file={P / 'apiserver.key'}",
            f"--client-ca-file={P / 'ca.crt'}", "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={pki.SERVICE_CIDR}", "--allow-privileged=true",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={P / 'sa.pub'}", f"--service-account-signing-key-file={P / 'sa.key'}",
            f"--requestheader-client-ca-file={P / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={P / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={P / 'front-proxy-client.key'}",
            f"--cert-dir={self.dir / 'apiserver-certs'}", "--profiling=false", "--v=1"])
        ssl_ctx = self._ssl()
        self._wait("kube-apiserver /readyz", lambda: self._get(self.server + "/readyz", ssl_ctx)[0] == 200,
                   90, "kube-apiserver")
        log(f"kube-apiserver ready after {time.monotonic() - t0:.1f} s")
        self._spawn("kube-controller-manager", [
            str(b / "kube-controller-manager"), f"--kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
            f"--authentication-kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
            f"--authorization-kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['controller_manager']}",
            "--leader-elect=false", "--controllers=*", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={P / 'sa.key'}", f"--root-ca-file={P / 'ca.crt'}",
            f"--cluster-signing-cert-file={P / 'ca.crt'}", f"--cluster-signing-key-file={P / 'ca.key'}",
            f"--service-cluster-ip-range={pki.SERVICE_CIDR}",
            "--horizontal-pod-autoscaler-sync-period=2s",
            "--horizontal-pod-autoscaler-downscale-stabilization=10s", "--v=1"])
        self._spawn("kube-scheduler", [
            str(b / "kube-scheduler"), f"--kubeconfig={self.dir / 'scheduler.kubeconfig'}",
            f"--authentication-kubeconfig={self.dir / 'scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={self.dir / 'scheduler.kubeconfig'}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}", "--leader-elect=false", "--v=1"])
        stages = b.parent / "stages"
        self._spawn("kwok", [
            str(b / "kwok"), f"--kubeconfig={self.dir / 'kwok.kubeconfig'}",
            *[f"--config={f}" for f in sorted(stages.glob("*.yaml"))],
            f"--manage-nodes-with-label-selector={KWOK_NODE_LABEL}=kwok",
            f"--server-address=127.0.0.1:{ports['kwok']}", f"--cidr={POD_CIDR}",
            f"--node-ip={ADVERTISE_ADDRESS}", "--node-lease-duration-seconds=40"])
        self._spawn("custom-metrics", [
            sys.executable, str(Path(__file__).with_name("custom_metrics.py")), f"--port={ports['custom_metrics']}",
            f"--cert={P / 'custom-metrics-serving.crt'}", f"--key={P / 'custom-metrics-serving.key'}",
            f"--apiserver={self.server}", f"--ca={P / 'ca.crt'}",
            f"--client-cert={P / 'custom-metrics.crt'}", f"--client-key={P / 'custom-metrics.key'}"])
        self.apply(self._bootstrap_objects())
        self._wait_ready()
        self.state["ready"] = True
        self.state["started_s"] = round(time.monotonic() - t0, 1)
        self._save()
        log(f"plane {self.name!r} ready in {self.state['started_s']} s")

    def _bootstrap_objects(self) -> list[dict]:
        ns, svc, port = pki.METRICS_NAMESPACE, pki.METRICS_SERVICE, self.state["ports"]["custom_metrics"]
        ca = (self.pki / "ca.crt").read_bytes()

        objs: list[dict] = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            # The aggregator resolves an ExternalName Service to its externalName: 127.0.0.1.
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": svc, "namespace": ns},
             "spec": {"type": "ExternalName", "externalName": "127.0.0.1",
                      "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
             "metadata": {"name": "v1beta2.custom.metrics.k8s.io"},
             "spec": {"group": "custom.metrics.k8s.io", "version": "v1beta2", "groupPriorityMinimum": 100,
                      "versionPriority": 200, "caBundle": base64.b64encode(ca).decode(),
                      "service": {"name": svc, "namespace": ns, "port": port}}},
        ]
        objs += [gpu_node(f"kwok-gpu-{i}", self.gpus_per_node) for i in range(self.num_gpu_nodes)]
        return objs

    def _wait_ready(self) -> None:
        def nodes_ready() -> bool:
            out = self.kubectl("get", "nodes", "-l", f"{KWOK_NODE_LABEL}=kwok", "-o", "json", check=False)
            items = json.loads(out or '{"items": []}')["items"]
            ready = [n for n in items if any(c["type"] == "Ready" and c["status"] == "True"
                                             for c in n.get("status", {}).get("conditions", []))]
            return len(ready) == self.num_gpu_nodes

        self._wait(f"{self.num_gpu_nodes} kwok nodes Ready", nodes_ready, 60, "kwok")
        self._wait("ServiceAccount default/default",
                   lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False) != "",
                   60, "kube-controller-manager")

        def metrics_api() -> bool:
            out = self.kubectl("get", "apiservice", "v1beta2.custom.metrics.k8s.io", "-o", "json", check=False)
            conds = json.loads(out or "{}").get("status", {}).get("conditions", [])
            return any(c["type"] == "Available" and c["status"] == "True" for c in conds)

        self._wait("APIService v1beta2.custom.metrics.k8s.io Available", metrics_api, 60, "custom-metrics")

    def down(self, quiet: bool = False, remove: bool = False) -> None:
        """Stops this plane's processes (newest first) and removes its etcd data (its whole folder
        with remove=True)."""
        running = self.pids()
        for comp in reversed(COMPONENTS):
            if comp in running:
                try:
                    os.kill(running[comp], signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3  # then SIGKILL: the data goes anyway, and a clean stop takes 10 s
        marker = str(self.dir) + "/"
        while time.monotonic() < deadline and any(_alive(p, marker) for p in running.values()):
            time.sleep(0.1)
        for p in running.values():
            if _alive(p, marker):
                os.kill(p, signal.SIGKILL)
            procs.forget(p)
        for proc in self._procs.values():  # reap our own children
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        subprocess.run(["rm", "-rf", str(self.dir if remove else self.dir / "etcd")], check=False)
        if self.state and not remove:
            self.state.update(pids={}, ready=False)
            self._save()
        if running and not quiet:
            log(f"plane {self.name!r} stopped ({', '.join(running)})")

    def status(self) -> dict:
        return {"name": self.name, "dir": str(self.dir), "healthy": self.is_healthy(),
                "running": sorted(self.pids()), "ports": self.state.get("ports", {}),
                "kubeconfig": self.kubeconfig}


def reap_stale(prefix: str, home: Path = PLANES_HOME) -> None:
    """Stops and removes planes named <prefix><pid> whose owning process (pid) is gone: what a
    killed test run left behind."""
    for d in Path(home).glob(f"{prefix}*"):
        pid = d.name[len(prefix):]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            Plane(d.name, home=Path(home)).down(quiet=True, remove=True)


def gpu_node(name: str, gpus: int, labels: dict[str, str] | None = None) -> dict:
    """A fake node that kwok manages (label KWOK_NODE_LABEL=kwok), with gpus nvidia.com/gpu."""
    capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(gpus),
                "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
                     "labels": {KWOK_NODE_LABEL: "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "type": "kwok", "nvidia.com/gpu.present": "true",
                                "nvidia.com/gpu.count": str(gpus), **(labels or {})}},
        "spec": {},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the Kiln test control plane")
    p.add_argument("command", choices=["up", "down", "status", "env"])
    p.add_argument("--name", default=os.environ.get("KILN_PLANE", "dev"))
    p.add_argument("--gpu-nodes", type=int, default=int(os.environ.get("KILN_PLANE_GPU_NODES", "2")))
    p.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("KILN_PLANE_GPUS_PER_NODE", "4")))
    a = p.parse_args(argv)
    procs.interrupt_on_signals()  # a SIGTERM during `up` stops what it started, like Ctrl-C
    plane = Plane(a.name, a.gpu_nodes, a.gpus_per_node)
    if a.command == "up":
        plane.up()
        print(f"export KUBECONFIG={plane.kubeconfig}")
    elif a.command == "down":
        plane.down()
    elif a.command == "env":
        print(f"export KUBECONFIG={plane.kubeconfig}")
    else:
        st = plane.status()
        print(json.dumps(st, indent=2))
        return 0 if st["healthy"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
