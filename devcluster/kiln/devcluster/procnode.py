"""A process-backed node for the test plane: a tiny kubelet that runs pods as local processes.

    python -m kiln.devcluster.procnode run [--plane dev] [--name proc-0] [--gpus 4]
    python -m kiln.devcluster.procnode logs NAMESPACE POD [--container kiln] [--plane dev]

Test infrastructure, not product code.  The agent

- registers Node NAME labelled ``kiln.dev/node-kind=process`` (kwok manages only ``=kwok``, see
  plane.py) with ``nvidia.com/gpu`` capacity, keeps its Ready condition and its Lease in
  ``kube-node-lease`` fresh (the node lifecycle controller would taint it otherwise);
- provisions PersistentVolumes: each pending claim gets a ``hostPath`` PV pre-bound to it whose
  folder is ``<state>/volumes/<ns>_<claim>_<uid8>`` (the plane has no storage provisioner);
- runs every pod bound to NAME: each container's ``command + args`` is started as a process
  group that ends with the agent (``procs.spawn(bind=True)``), ``PATH`` starting with the repo's ``.venv/bin`` (so the runtime image's ``kiln``
  resolves to /work/main/.venv/bin/kiln); volume mounts are mapped onto host folders by
  rewriting paths (an argument, env value or working dir equal to or under a ``mountPath``
  becomes the host folder: PVC -> its PV's folder, emptyDir -> ``<pod dir>/volumes/<name>``,
  hostPath -> itself, configMap/secret/projected -> files written there);
- projects service-account tokens as the kubelet does (proc_volumes.py): the volume the
  ServiceAccount admission plugin adds gets a bound token from the TokenRequest API (refreshed
  at 80% of its lifetime), the namespace's ``kube-root-ca.crt`` as ``ca.crt`` and the namespace;
  each container runs in its own mount namespace (``unshare --mount``; root or CAP_SYS_ADMIN)
  where mounts under ``/var/run/secrets/`` are bind-mounted at their mountPath, and with
  ``KUBERNETES_SERVICE_HOST/PORT`` naming the API server, so in-cluster clients (the chart's
  operator pod) authenticate as the pod's ServiceAccount;
- gives each pod its own IP, set as ``status.podIP``: 10.244.250.x added to the loopback
  interface as a /32 (``ip addr add``, removed when the pod ends; EndpointSlices refuse
  127.0.0.0/8, so a plain loopback IP would leave Services without endpoints; without
  CAP_NET_ADMIN it falls back to 127.0.250.x and proc_proxy.py then routes to Ready pods
  directly).  All pods share the host's network namespace, so a wildcard listen address (``0.0.0.0``) in args or env is
  rewritten to the pod IP: two replicas can both listen on :8000; Python processes also bind
  the pod IP for a wildcard ``bind()`` (pod_site/sitecustomize.py, first on their PYTHONPATH);
- gives each ClusterIP Service an address of its own with a proxy per port, and pods' Python
  processes the names ``<service>.<namespace>.svc[.cluster.local]`` (``kubernetes.default.svc``
  too): what kube-proxy and the cluster DNS do (proc_services.py; ``service_network=False``
  turns that off);
- evaluates startup, readiness and liveness probes for real (httpGet, tcpSocket, exec) with
  the pod's periods and thresholds; liveness or startup failure restarts the container;
- turns exit codes into container states and the pod phase (``restartPolicy: Never`` ->
  Succeeded/Failed, so Jobs complete; ``Always`` -> restart with back-off, CrashLoopBackOff);
- writes logs to ``<state>/pods/<ns>_<pod>_<uid8>/<container>.log``, served to ``kubectl logs``
  (``--follow``, ``--tail``) by a kubelet-like HTTPS endpoint (self-signed, on 127.0.0.1, the
  node's ``daemonEndpoints.kubeletEndpoint.Port``); ``python -m kiln.devcluster.procnode logs NS POD`` prints
  the file;
- on deletion sends SIGTERM to the process group, SIGKILL after the grace period (capped by
  ``max_grace_seconds``), then removes the pod object (grace 0), as the kubelet does.

Endpoints/EndpointSlices work because podIP and the Ready condition are real.  The host model
cache (``$KILN_CACHE_DIR`` or ``~/.cache/kiln``) is handed to pods as ``KILN_CACHE_DIR``, the way
a node's pre-pulled image layer would be (``share_model_cache=False`` turns that off).

``<state>`` is ``<plane dir>/procnode/<node>`` by default.  One pod's life (volumes, processes,
probes, status, deletion) is ``proc_pod.PodRunner``; this module is the node around it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kiln.devcluster import procs
from kiln.devcluster.proc_pod import PodRunner, _api, map_value, now_iso, now_micro  # noqa: F401 (map_value: re-exported)
from kiln.devcluster.proc_services import ServiceNetwork
from kiln.devcluster.proc_volumes import can_make_mount_namespaces

NODE_KIND_LABEL = "kiln.dev/node-kind"
NODE_KIND = "process"

log = logging.getLogger("procnode")


# --- the node ----------------------------------------------------------------------------------

class ProcNode:
    """The agent.  ``start()`` runs it in background threads; ``stop()`` kills its pods."""

    def __init__(self, kubeconfig: str, name: str = "proc-0", state_dir: Path | str | None = None,
                 gpus: int = 4, cpu: str = "32", memory: str = "256Gi", ip_subnet: int = 250,
                 apiserver_port: int = 443, share_model_cache: bool = True, max_grace_seconds: float = 30,
                 provision_volumes: bool = True, extra_env: dict[str, str] | None = None,
                 poll_seconds: float = 0.5, loopback_ips: bool = False, mount_namespaces: bool | None = None,
                 service_network: bool = True):
        self.kubeconfig, self.name = kubeconfig, name
        self.state_dir = Path(state_dir or Path(kubeconfig).parent / "procnode" / name)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.gpus, self.cpu, self.memory = gpus, cpu, memory
        self.ip_subnet = ip_subnet
        self.loopback_ips = loopback_ips  # True: 127.0.<ip_subnet>.x, no `ip addr add` (no CAP_NET_ADMIN)
        self.ip_prefix = f"127.0.{ip_subnet}" if loopback_ips else f"10.244.{ip_subnet}"
        self.apiserver_port = apiserver_port
        self.model_cache = (os.environ.get("KILN_CACHE_DIR") or str(Path.home() / ".cache" / "kiln")) \
            if share_model_cache else None
        self.max_grace_seconds = max_grace_seconds
        self.provision_volumes = provision_volumes
        self.extra_env = dict(extra_env or {})
        self.poll_seconds = poll_seconds
        # None: use a private mount namespace per container when this process may make one.
        self.mount_namespaces = can_make_mount_namespaces() if mount_namespaces is None else mount_namespaces
        if not self.mount_namespaces:
            log.warning("no mount namespaces (needs root or CAP_SYS_ADMIN): pods will not find their "
                        "service-account token at /var/run/secrets/kubernetes.io/serviceaccount")
        self.service_network = service_network
        self.services: ServiceNetwork | None = None  # set by start() with service_network
        self.hosts_file = self.state_dir / "hosts"  # the Services' names (proc_services.py)
        self.stopping = threading.Event()
        self.kubelet_port = 0
        self._log_srv = None
        self.runners: dict[str, PodRunner] = {}
        self._ips_lock = threading.Lock()
        self._ips_used: set[str] = set()
        self._threads: list[threading.Thread] = []
        self.api = _api(kubeconfig)

    # -- IPs --
    def take_ip(self) -> str:
        """A pod IP: ``10.244.<ip_subnet>.x`` added to ``lo`` as a /32 (EndpointSlices refuse
        loopback addresses).  An address already on ``lo`` (another node's pod) is skipped, so
        nodes of several planes never share one.  Without the right to add addresses
        (CAP_NET_ADMIN) it falls back to 127.0.<ip_subnet>.x, where Services get no endpoints."""
        with self._ips_lock:
            if self.loopback_ips:
                return self._take_loopback()
            for x in range(2, 255):
                ip = f"{self.ip_prefix}.{x}"
                if ip in self._ips_used:
                    continue
                try:
                    r = subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], capture_output=True, text=True)
                except OSError as e:  # no `ip` command
                    r = subprocess.CompletedProcess([], 1, "", str(e))
                if r.returncode == 0:
                    self._ips_used.add(ip)
                    return ip
                if "exists" not in r.stderr and "already assigned" not in r.stderr:  # taken: try the next
                    log.warning("cannot add pod IPs to lo (%s): falling back to 127.0.%d.x; Services will "
                                "have no endpoints", r.stderr.strip(), self.ip_subnet)
                    self.loopback_ips = True
                    self.ip_prefix = f"127.0.{self.ip_subnet}"
                    return self._take_loopback()
        raise RuntimeError("no free pod IP")

    def _take_loopback(self) -> str:
        for x in range(2, 255):
            ip = f"{self.ip_prefix}.{x}"
            if ip not in self._ips_used:
                self._ips_used.add(ip)
                return ip
        raise RuntimeError("no free pod IP")

    def release_ip(self, ip: str) -> None:
        with self._ips_lock:
            self._ips_used.discard(ip)
            if not self.loopback_ips and ip.startswith(self.ip_prefix + "."):
                subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], capture_output=True)

    # -- the Node object --
    def node_object(self) -> dict:
        cap = {"cpu": self.cpu, "memory": self.memory, "pods": "110", "nvidia.com/gpu": str(self.gpus),
               "ephemeral-storage": "1Ti"}
        return {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": {
                    NODE_KIND_LABEL: NODE_KIND, "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64", "nvidia.com/gpu.present": "true",
                    "nvidia.com/gpu.count": str(self.gpus)}},
                "spec": {}, "status": {"capacity": cap, "allocatable": dict(cap)}}

    def _node_status(self) -> dict:
        t = now_iso()
        cap = self.node_object()["status"]["capacity"]
        conds = [{"type": ty, "status": "False", "reason": f"KubeletHas{r}", "message": "procnode",
                  "lastHeartbeatTime": t, "lastTransitionTime": self._started_at}
                 for ty, r in (("MemoryPressure", "SufficientMemory"), ("DiskPressure", "NoDiskPressure"),
                               ("PIDPressure", "SufficientPID"))]
        conds.append({"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "procnode is ready",
                      "lastHeartbeatTime": t, "lastTransitionTime": self._started_at})
        return {"status": {"capacity": cap, "allocatable": dict(cap), "conditions": conds,
                           # No Hostname address: the API server would dial it for `kubectl logs`.
                           "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                           "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
                           "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux",
                                        "kubeletVersion": "v0.0.0-procnode", "kubeProxyVersion": "",
                                        "containerRuntimeVersion": "proc://1", "osImage": "host",
                                        "kernelVersion": os.uname().release, "machineID": "", "systemUUID": "",
                                        "bootID": ""}}}

    def register(self) -> None:
        from kubernetes.client.rest import ApiException
        self._started_at = now_iso()
        try:
            self.api.create_node(self.node_object())
        except ApiException as e:
            if e.status != 409:
                raise
            self.api.patch_node(self.name, {"metadata": {"labels": self.node_object()["metadata"]["labels"]}})
        self.api.patch_node_status(self.name, self._node_status())
        self._heartbeat_lease()

    def _heartbeat_lease(self) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException
        coord = client.CoordinationV1Api(self.api.api_client)
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": now_micro()}}
        try:
            coord.patch_namespaced_lease(self.name, "kube-node-lease", {"spec": body["spec"]})
        except ApiException as e:
            if e.status != 404:
                raise
            coord.create_namespaced_lease("kube-node-lease", body)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(10):
            try:
                self.api.patch_node_status(self.name, self._node_status())
                self._heartbeat_lease()
            except Exception as e:  # noqa: BLE001
                log.warning("node heartbeat failed: %s", e)

    # -- volumes --
    def _provision_loop(self) -> None:
        from kubernetes.client.rest import ApiException
        api = _api(self.kubeconfig)
        while not self.stopping.wait(1):
            try:
                pvcs = api.list_persistent_volume_claim_for_all_namespaces().items
                for pvc in pvcs:
                    if pvc.spec.volume_name or pvc.status.phase != "Pending" or pvc.metadata.deletion_timestamp:
                        continue
                    m = pvc.metadata
                    path = self.state_dir.parent / "volumes" / f"{m.namespace}_{m.name}_{m.uid[:8]}"
                    path.mkdir(parents=True, exist_ok=True)
                    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
                          "metadata": {"name": f"proc-{m.namespace}-{m.name}"[:240] + f"-{m.uid[:8]}",
                                       "labels": {"kiln.dev/procnode": self.name}},
                          "spec": {"capacity": {"storage": (pvc.spec.resources.requests or {}).get("storage", "1Gi")},
                                   "accessModes": pvc.spec.access_modes or ["ReadWriteOnce"],
                                   "persistentVolumeReclaimPolicy": "Retain",
                                   "storageClassName": pvc.spec.storage_class_name or "",
                                   "volumeMode": pvc.spec.volume_mode or "Filesystem",
                                   "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                                   "claimRef": {"namespace": m.namespace, "name": m.name, "uid": m.uid}}}
                    try:
                        api.create_persistent_volume(pv)
                        log.info("provisioned %s for claim %s/%s", path, m.namespace, m.name)
                    except ApiException as e:
                        if e.status != 409:
                            raise
            except Exception as e:  # noqa: BLE001
                log.warning("provisioner: %s", e)

    # -- Services --
    def _services_loop(self) -> None:
        while True:
            try:
                self.services.sync()
            except Exception as e:  # noqa: BLE001 - retried next second
                log.warning("services: %s", e)
            if self.stopping.wait(1):
                return

    # -- pods --
    def _pods_loop(self) -> None:
        api = _api(self.kubeconfig)
        while not self.stopping.is_set():
            try:
                pods = api.api_client.sanitize_for_serialization(
                    api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}")).get("items", [])
            except Exception as e:  # noqa: BLE001
                log.warning("listing pods failed: %s", e)
                self.stopping.wait(2)
                continue
            seen = set()
            for pod in pods:
                uid = pod["metadata"]["uid"]
                seen.add(uid)
                r = self.runners.get(uid)
                if r is None:
                    if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and \
                            not pod["metadata"].get("deletionTimestamp"):
                        continue  # finished before this agent started
                    orphan = bool((pod.get("status") or {}).get("podIP"))  # ran under an earlier agent
                    if orphan:
                        log.warning("%s/%s ran under an earlier agent: deleting it (its controller recreates it)",
                                    pod["metadata"]["namespace"], pod["metadata"]["name"])
                    if pod["metadata"].get("deletionTimestamp") or orphan:
                        # Nothing runs for it here (finished earlier or never started): finish the delete.
                        try:
                            api.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                                      grace_period_seconds=0,
                                                      body={"preconditions": {"uid": uid}, "gracePeriodSeconds": 0})
                        except Exception:  # noqa: BLE001
                            pass
                        continue
                    r = PodRunner(self, pod, self.take_ip())
                    self.runners[uid] = r
                    r.start()
                else:
                    r.update(pod)
            for uid, r in list(self.runners.items()):
                if uid not in seen:
                    r.update(None)
                if r.finished:
                    self.runners.pop(uid, None)
            self.stopping.wait(self.poll_seconds)

    # -- `kubectl logs`: the kubelet's /containerLogs endpoint over TLS --
    def _log_server(self):
        import http.server
        import ssl
        import urllib.parse
        cert, key = self.state_dir / "kubelet.crt", self.state_dir / "kubelet.key"
        if not cert.exists():
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                            "-nodes", "-days", "365", "-subj", f"/CN={self.name}",
                            "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                           check=True, capture_output=True)
        node = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self.send_error(404)
                    return
                _, ns, pod, container = parts
                q = urllib.parse.parse_qs(url.query)
                path = pod_log_path(node.state_dir, ns, pod, container)
                if path is None:
                    self.send_error(404, f"no log for {ns}/{pod}/{container}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                data = path.read_bytes()
                if q.get("tailLines"):
                    data = b"".join(data.splitlines(keepends=True)[-int(q["tailLines"][0]):])
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                    if q.get("follow", ["false"])[0] == "true":
                        with open(path, "rb") as f:
                            f.seek(0, 2)
                            while not node.stopping.is_set():
                                chunk = f.read()
                                if chunk:
                                    self.wfile.write(chunk)
                                    self.wfile.flush()
                                else:
                                    time.sleep(0.5)
                except OSError:
                    pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        self._log_srv = srv
        self.kubelet_port = srv.server_address[1]
        threading.Thread(target=srv.serve_forever, daemon=True, name="procnode-logs").start()

    def start(self) -> "ProcNode":
        try:
            self._log_server()
        except Exception as e:  # noqa: BLE001 - a bonus: logs stay readable as files
            log.warning("no kubectl logs endpoint: %s", e)
        self.register()
        loops = [self._heartbeat_loop, self._pods_loop]
        if self.provision_volumes:
            loops.append(self._provision_loop)
        if self.service_network:
            self.services = ServiceNetwork(_api(self.kubeconfig), self.hosts_file, self.take_ip, self.release_ip,
                                           self.apiserver_port)
            self.services.sync()  # the Services that exist have their names before the first pod starts
            loops.append(self._services_loop)
        for fn in loops:
            t = threading.Thread(target=fn, name=f"procnode-{fn.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("node %s registered (state in %s)", self.name, self.state_dir)
        return self

    def stop(self, delete_node: bool = True) -> None:
        """Stops the loops and kills every pod's processes (SIGTERM, then SIGKILL after 5 s)."""
        self.stopping.set()
        for r in list(self.runners.values()):
            for cr in r.containers:
                if cr.proc is not None and cr.proc.poll() is None:
                    try:
                        os.killpg(cr.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
        deadline = time.monotonic() + 5
        for r in list(self.runners.values()):
            for cr in r.containers:
                if cr.proc is not None:
                    try:
                        cr.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        try:
                            os.killpg(cr.proc.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        cr.proc.wait()
                    procs.forget(cr.proc.pid)
        for t in self._threads:
            t.join(timeout=5)
        if self.services is not None:
            self.services.stop()
        if self._log_srv is not None:
            self._log_srv.shutdown()
            self._log_srv.server_close()
        if delete_node:
            try:
                self.api.delete_node(self.name)
            except Exception:  # noqa: BLE001
                pass

    def pod_dir(self, namespace: str, pod: str) -> Path | None:
        found = sorted((self.state_dir / "pods").glob(f"{namespace}_{pod}_*"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None


def pod_log_path(state_dir: Path, namespace: str, pod: str, container: str = "kiln") -> Path | None:
    """The log file of a container of a pod that a ProcNode with ``state_dir`` ran."""
    found = sorted(Path(state_dir).glob(f"pods/{namespace}_{pod}_*/{container}.log"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> int:
    from kiln.devcluster.plane import Plane

    p = argparse.ArgumentParser(description="a process-backed node for the test plane")
    p.add_argument("command", choices=["run", "logs"])
    p.add_argument("args", nargs="*")
    p.add_argument("--plane", default=os.environ.get("KILN_PLANE", "dev"))
    p.add_argument("--name", default="proc-0")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--container", default="kiln")
    a = p.parse_args(argv)
    plane = Plane(a.plane)
    state = Path(plane.dir) / "procnode" / a.name
    if a.command == "logs":
        ns, pod = a.args
        path = pod_log_path(state, ns, pod, a.container)
        if path is None:
            print(f"no log for {ns}/{pod} under {state}", file=sys.stderr)
            return 1
        sys.stdout.write(path.read_text(errors="replace"))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = ProcNode(plane.kubeconfig, a.name, state, gpus=a.gpus,
                    apiserver_port=plane.state["ports"]["apiserver"]).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
