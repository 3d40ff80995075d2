"""A process-backed node for the test plane: a tiny kubelet that runs pods as local processes.

    python tests/cluster/procnode.py run [--plane dev] [--name proc-0] [--gpus 4]
    python tests/cluster/procnode.py logs NAMESPACE POD [--container kiln] [--plane dev]

Test infrastructure, not product code.  The agent

- registers Node NAME labelled ``kiln.dev/node-kind=process`` (kwok manages only ``=kwok``, see
  plane.py) with ``nvidia.com/gpu`` capacity, keeps its Ready condition and its Lease in
  ``kube-node-lease`` fresh (the node lifecycle controller would taint it otherwise);
- provisions PersistentVolumes: each pending claim gets a ``hostPath`` PV pre-bound to it whose
  folder is ``<state>/volumes/<ns>_<claim>_<uid8>`` (the plane has no storage provisioner);
- runs every pod bound to NAME: each container's ``command + args`` is started as a process
  group, ``PATH`` starting with the repo's ``.venv/bin`` (so the runtime image's ``kiln``
  resolves to /work/main/.venv/bin/kiln); volume mounts are mapped onto host folders by
  rewriting paths (an argument, env value or working dir equal to or under a ``mountPath``
  becomes the host folder: PVC -> its PV's folder, emptyDir -> ``<pod dir>/volumes/<name>``,
  hostPath -> itself, configMap/secret/projected -> files written there);
- gives each pod its own IP, set as ``status.podIP``: 10.244.250.x added to the loopback
  interface as a /32 (``ip addr add``, removed when the pod ends; EndpointSlices refuse
  127.0.0.0/8, so a plain loopback IP would leave Services without endpoints; without
  CAP_NET_ADMIN it falls back to 127.0.250.x).  All pods share the host's network namespace, so a wildcard listen address (``0.0.0.0``) in args or env is
  rewritten to the pod IP: two replicas can both listen on :8000;
- evaluates startup, readiness and liveness probes for real (httpGet, tcpSocket, exec) with
  the pod's periods and thresholds; liveness or startup failure restarts the container;
- turns exit codes into container states and the pod phase (``restartPolicy: Never`` ->
  Succeeded/Failed, so Jobs complete; ``Always`` -> restart with back-off, CrashLoopBackOff);
- writes logs to ``<state>/pods/<ns>_<pod>_<uid8>/<container>.log`` (``procnode.py logs``
  prints them; ``kubectl logs`` is not supported);
- on deletion sends SIGTERM to the process group, SIGKILL after the grace period (capped by
  ``max_grace_seconds``), then removes the pod object (grace 0), as the kubelet does.

Endpoints/EndpointSlices work because podIP and the Ready condition are real.  The host model
cache (``$KILN_CACHE_DIR`` or ``~/.cache/kiln``) is handed to pods as ``KILN_CACHE_DIR``, the way
a node's pre-pulled image layer would be (``share_model_cache=False`` turns that off).

``<state>`` is ``<plane dir>/procnode/<node>`` by default.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV_BIN = REPO / ".venv" / "bin"
NODE_KIND_LABEL = "kiln.dev/node-kind"
NODE_KIND = "process"

log = logging.getLogger("procnode")


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _api(kubeconfig: str):
    from kubernetes import client, config
    return client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))


def _map_path(v: str, mounts: list[tuple[str, str]]) -> str | None:
    for cpath, hpath in mounts:  # longest mountPath first
        c = cpath.rstrip("/") or "/"
        if v == c or v.startswith(c + "/"):
            return hpath + v[len(c):]
    return None


def map_value(s: str, mounts: list[tuple[str, str]], pod_ip: str) -> str:
    """Rewrites a container path (equal to or under a mountPath, also after ``key=``) to the
    host folder, and the wildcard address to the pod IP."""
    if s == "0.0.0.0":
        return pod_ip
    s = s.replace("0.0.0.0:", f"{pod_ip}:")
    mapped = _map_path(s, mounts)
    if mapped is not None:
        return mapped
    key, sep, val = s.partition("=")
    if sep and (mapped := _map_path(val, mounts)) is not None:
        return key + sep + mapped
    return s


# --- probes ------------------------------------------------------------------------------------

@dataclass
class ProbeState:
    spec: dict
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        self.next_at = now + float(self.spec.get("periodSeconds", 10))
        if ok:
            self.successes, self.failures = self.successes + 1, 0
        else:
            self.successes, self.failures = 0, self.failures + 1


def _port(spec_port: Any, container: dict) -> int:
    if isinstance(spec_port, int) or str(spec_port).isdigit():
        return int(spec_port)
    for p in container.get("ports") or []:
        if p.get("name") == spec_port:
            return int(p["containerPort"])
    raise ValueError(f"unknown port name {spec_port!r}")


# --- one container -----------------------------------------------------------------------------

@dataclass
class ContainerRun:
    spec: dict
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: str | None = None
    restart_count: int = 0
    started: bool = False  # startup probe passed (or none)
    ready: bool = False
    terminated: dict | None = None  # last termination {exitCode, reason, startedAt, finishedAt}
    last_state: dict = field(default_factory=dict)
    waiting_reason: str | None = "ContainerCreating"
    waiting_message: str = ""
    restart_at: float = 0.0
    probes: dict[str, ProbeState] = field(default_factory=dict)
    run_started: float = 0.0

    @property
    def name(self) -> str:
        return self.spec["name"]

    def status(self) -> dict:
        st: dict[str, Any] = {"name": self.name, "image": self.spec.get("image", ""),
                              "imageID": "", "restartCount": self.restart_count,
                              "ready": self.ready, "started": self.started}
        if self.proc is not None and self.proc.poll() is None:
            st["containerID"] = f"proc://{self.proc.pid}"
            st["state"] = {"running": {"startedAt": self.started_at}}
        elif self.terminated is not None and self.waiting_reason is None:
            st["state"] = {"terminated": self.terminated}
        else:
            w = {"reason": self.waiting_reason or "ContainerCreating"}
            if self.waiting_message:
                w["message"] = self.waiting_message
            st["state"] = {"waiting": w}
        if self.last_state:
            st["lastState"] = self.last_state
        return st


# --- one pod -----------------------------------------------------------------------------------

class PodRunner(threading.Thread):
    """Runs one pod until it is deleted (then finalizes the deletion)."""

    TICK = 0.25

    def __init__(self, node: "ProcNode", pod: dict, ip: str):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.node, self.pod, self.ip = node, pod, ip
        self.ns, self.pname, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = node.state_dir / "pods" / f"{self.ns}_{self.pname}_{self.uid[:8]}"
        self.api = _api(node.kubeconfig)
        self.lock = threading.Lock()
        self.gone = False  # the pod object vanished (force delete)
        self.finished = False  # thread done
        self.mounts: list[tuple[str, str]] | None = None
        self.containers: list[ContainerRun] = []
        self.start_time = now_iso()
        self.last_status: dict | None = None
        self.cond_times: dict[str, tuple[str, str]] = {}

    # -- inputs from the node loop --
    def update(self, pod: dict | None) -> None:
        with self.lock:
            if pod is None:
                self.gone = True
            else:
                self.pod = pod

    # -- volumes --
    def _volume_dir(self, vol: dict) -> str | None:
        name = vol["name"]
        vdir = self.dir / "volumes" / name
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            pvc = self.api.read_namespaced_persistent_volume_claim(claim, self.ns)
            if not pvc.spec.volume_name or pvc.status.phase != "Bound":
                return None
            pv = self.api.read_persistent_volume(pvc.spec.volume_name)
            if pv.spec.host_path is None:
                raise RuntimeError(f"PV {pv.metadata.name} is not a hostPath volume")
            Path(pv.spec.host_path.path).mkdir(parents=True, exist_ok=True)
            return pv.spec.host_path.path
        if "hostPath" in vol:
            return vol["hostPath"]["path"]
        vdir.mkdir(parents=True, exist_ok=True)
        if "configMap" in vol or "secret" in vol:
            self._write_keys(vol, vdir)
        elif "projected" in vol:
            for src in vol["projected"].get("sources") or []:
                try:
                    self._write_projected(src, vdir)
                except Exception as e:  # noqa: BLE001 - best effort (the SA token of a pod)
                    log.debug("projected source %s of %s: %s", src, self.pname, e)
        return str(vdir)

    def _write_keys(self, vol: dict, vdir: Path) -> None:
        if "configMap" in vol:
            cm = self.api.read_namespaced_config_map(vol["configMap"]["name"], self.ns)
            data = {k: v.encode() for k, v in (cm.data or {}).items()}
        else:
            sec = self.api.read_namespaced_secret(vol["secret"]["secretName"], self.ns)
            data = {k: base64.b64decode(v) for k, v in (sec.data or {}).items()}
        for k, v in data.items():
            (vdir / k).write_bytes(v)

    def _write_projected(self, src: dict, vdir: Path) -> None:
        if "serviceAccountToken" in src:
            sa = self.pod["spec"].get("serviceAccountName") or "default"
            tr = self.api.create_namespaced_service_account_token(sa, self.ns, {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": int(src["serviceAccountToken"].get("expirationSeconds", 3600))}})
            (vdir / src["serviceAccountToken"].get("path", "token")).write_text(tr.status.token)
        elif "configMap" in src:
            cm = self.api.read_namespaced_config_map(src["configMap"]["name"], self.ns)
            for item in src["configMap"].get("items") or [{"key": k, "path": k} for k in cm.data or {}]:
                (vdir / item["path"]).write_text((cm.data or {}).get(item["key"], ""))
        elif "downwardAPI" in src:
            for item in src["downwardAPI"].get("items") or []:
                fp = (item.get("fieldRef") or {}).get("fieldPath", "")
                (vdir / item["path"]).write_text(self._field(fp))

    def _field(self, path: str) -> str:
        meta = self.pod["metadata"]
        return {"metadata.name": self.pname, "metadata.namespace": self.ns, "metadata.uid": self.uid,
                "status.podIP": self.ip, "status.hostIP": "127.0.0.1", "spec.nodeName": self.node.name,
                "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName", "default"),
                }.get(path) or (meta.get("labels") or {}).get(path[len("metadata.labels['"):-2], "")

    def _prepare(self) -> bool:
        """Maps the pod's volumes; False while a claim is not bound yet."""
        by_name: dict[str, str] = {}
        for vol in self.pod["spec"].get("volumes") or []:
            d = self._volume_dir(vol)
            if d is None:
                return False
            by_name[vol["name"]] = d
        self._vols = by_name
        return True

    def _mounts(self, c: dict) -> list[tuple[str, str]]:
        out = []
        for m in c.get("volumeMounts") or []:
            host = self._vols[m["name"]]
            if m.get("subPath"):
                host = str(Path(host) / m["subPath"])
                Path(host).mkdir(parents=True, exist_ok=True)
            out.append((m["mountPath"], host))
        return sorted(out, key=lambda x: -len(x[0]))

    # -- processes --
    def _env(self, c: dict, mounts: list[tuple[str, str]]) -> dict[str, str]:
        env = {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOSTNAME": self.pname, "HOME": str(self.dir / "home"), "LANG": "C.UTF-8",
               "PYTHONUNBUFFERED": "1", "KUBERNETES_SERVICE_HOST": "127.0.0.1",
               "KUBERNETES_SERVICE_PORT": str(self.node.apiserver_port)}
        if self.node.model_cache:
            env["KILN_CACHE_DIR"] = self.node.model_cache
        env.update(self.node.extra_env)
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = e["value"]
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                try:
                    if "fieldRef" in vf:
                        env[e["name"]] = self._field(vf["fieldRef"]["fieldPath"])
                    elif "secretKeyRef" in vf:
                        s = self.api.read_namespaced_secret(vf["secretKeyRef"]["name"], self.ns)
                        env[e["name"]] = base64.b64decode((s.data or {})[vf["secretKeyRef"]["key"]]).decode()
                    elif "configMapKeyRef" in vf:
                        cm = self.api.read_namespaced_config_map(vf["configMapKeyRef"]["name"], self.ns)
                        env[e["name"]] = (cm.data or {})[vf["configMapKeyRef"]["key"]]
                except Exception:  # noqa: BLE001
                    if not (vf.get("secretKeyRef") or vf.get("configMapKeyRef") or {}).get("optional"):
                        raise
        return {k: map_value(v, mounts, self.ip) for k, v in env.items()}

    def _start(self, cr: ContainerRun) -> None:
        c = cr.spec
        mounts = self._mounts(c)
        argv = [map_value(a, mounts, self.ip) for a in (c.get("command") or []) + (c.get("args") or [])]
        env = self._env(c, mounts)
        Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
        if not argv:
            raise RuntimeError("container has no command (image entrypoints are unknown here)")
        exe = shutil.which(argv[0], path=env["PATH"]) if "/" not in argv[0] else argv[0]
        if exe is None:
            raise FileNotFoundError(f"{argv[0]}: not found on {env['PATH']}")
        cwd = map_value(c["workingDir"], mounts, self.ip) if c.get("workingDir") else str(self.dir)
        cr.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(cr.log_path, "ab") as out:
            out.write(f"--- {now_iso()} procnode: {shlex.join([exe, *argv[1:]])}\n".encode())
            out.flush()
            cr.proc = subprocess.Popen([exe, *argv[1:]], env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        cr.started_at = now_iso()
        cr.run_started = time.monotonic()
        cr.waiting_reason = None
        cr.terminated = None
        cr.ready = False
        cr.started = "startupProbe" not in c
        cr.probes = {k: ProbeState(c[k], next_at=time.monotonic() + float(c[k].get("initialDelaySeconds", 0)))
                     for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}
        log.info("%s/%s: started %s (pid %d, ip %s)", self.ns, self.pname, cr.name, cr.proc.pid, self.ip)

    def _kill(self, cr: ContainerRun, grace: float) -> None:
        p = cr.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=max(grace, 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()

    def _probe(self, spec: dict, c: dict) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        try:
            if "httpGet" in spec:
                g = spec["httpGet"]
                host = g.get("host") or self.ip
                url = f"{g.get('scheme', 'HTTP').lower()}://{host}:{_port(g['port'], c)}{g.get('path', '/')}"
                req = urllib.request.Request(url, headers={h["name"]: h["value"] for h in g.get("httpHeaders") or []})
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return 200 <= r.status < 400
            if "tcpSocket" in spec:
                t = spec["tcpSocket"]
                with socket.create_connection((t.get("host") or self.ip, _port(t["port"], c)), timeout=timeout):
                    return True
            if "exec" in spec:
                mounts = self._mounts(c)
                cmd = [map_value(a, mounts, self.ip) for a in spec["exec"]["command"]]
                return subprocess.run(cmd, env=self._env(c, mounts), timeout=timeout,
                                      capture_output=True).returncode == 0
        except (urllib.error.URLError, OSError, subprocess.TimeoutExpired, ValueError):
            return False
        return True

    def _tick_container(self, cr: ContainerRun, policy: str) -> None:
        now = time.monotonic()
        c = cr.spec
        if cr.proc is not None and cr.proc.poll() is not None and cr.waiting_reason is None and cr.terminated is None:
            rc = cr.proc.returncode
            rc = 128 - rc if rc < 0 else rc  # killed by signal N -> 128+N
            cr.terminated = {"exitCode": rc, "reason": "Completed" if rc == 0 else "Error",
                             "startedAt": cr.started_at, "finishedAt": now_iso(), "containerID": f"proc://{cr.proc.pid}"}
            cr.ready = False
            log.info("%s/%s: %s exited with %d", self.ns, self.pname, cr.name, rc)
            if policy == "Always" or (policy == "OnFailure" and rc != 0):
                cr.last_state = {"terminated": cr.terminated}
                backoff = min(10 * 2 ** cr.restart_count, 300) if now - cr.run_started < 600 else 10
                cr.restart_at = now + backoff
                cr.waiting_reason = "CrashLoopBackOff"
                cr.waiting_message = f"back-off {backoff}s restarting failed container"
                cr.restart_count += 1
        if cr.waiting_reason == "CrashLoopBackOff" and now >= cr.restart_at:
            self._start(cr)
            return
        if cr.proc is None or cr.proc.poll() is not None:
            return
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            ps = cr.probes.get(kind)
            if ps is None or not ps.due(now):
                continue
            if kind == "startupProbe" and cr.started:
                continue
            if kind != "startupProbe" and not cr.started:
                continue
            ok = self._probe(ps.spec, c)
            ps.record(ok, time.monotonic())
            thr_fail = int(ps.spec.get("failureThreshold", 3))
            thr_ok = int(ps.spec.get("successThreshold", 1))
            if kind == "startupProbe" and ok:
                cr.started = True
                for k in ("readinessProbe", "livenessProbe"):  # they start once the container has started
                    if k in cr.probes:
                        cr.probes[k].next_at = time.monotonic()
            elif kind == "readinessProbe":
                if ok and ps.successes >= thr_ok:
                    cr.ready = True
                elif not ok and ps.failures >= thr_fail:
                    cr.ready = False
            if not ok and kind in ("startupProbe", "livenessProbe") and ps.failures >= thr_fail:
                log.warning("%s/%s: %s failed %s %d times: restarting", self.ns, self.pname, cr.name, kind, thr_fail)
                self._kill(cr, float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)))
        if "readinessProbe" not in c:
            cr.ready = cr.started

    # -- status --
    def _cond(self, type_: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        prev = self.cond_times.get(type_)
        if prev is None or prev[0] != status:
            self.cond_times[type_] = (status, now_iso())
        return {"type": type_, "status": status, "lastProbeTime": None,
                "lastTransitionTime": self.cond_times[type_][1]}

    def _status(self, phase: str) -> dict:
        all_ready = bool(self.containers) and all(c.ready for c in self.containers) and phase == "Running"
        return {
            "phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self.start_time,
            "qosClass": "BestEffort",
            "conditions": [self._cond("PodReadyToStartContainers", True), self._cond("Initialized", True),
                           self._cond("ContainersReady", all_ready), self._cond("Ready", all_ready),
                           self._cond("PodScheduled", True)],
            "containerStatuses": [c.status() for c in self.containers],
        }

    def _patch(self, status: dict) -> None:
        if status == self.last_status:
            return
        try:
            self.api.patch_namespaced_pod_status(self.pname, self.ns, {"status": status})
            self.last_status = status
        except Exception as e:  # noqa: BLE001 - retried next tick
            if getattr(e, "status", None) == 404:
                self.gone = True
            else:
                log.warning("%s/%s: status patch failed: %s", self.ns, self.pname, e)

    def _phase(self, policy: str) -> str:
        if policy == "Always":
            return "Running"
        done = [c for c in self.containers if c.terminated is not None and c.waiting_reason is None]
        if len(done) < len(self.containers):
            return "Running"
        return "Succeeded" if all(c.terminated["exitCode"] == 0 for c in done) else "Failed"

    # -- the loop --
    def run(self) -> None:
        try:
            self._run()
        except Exception:  # noqa: BLE001
            log.exception("%s/%s: runner failed", self.ns, self.pname)
            for cr in self.containers:
                self._kill(cr, 1)
        finally:
            self.finished = True
            self.node.release_ip(self.ip)

    def _deleting(self) -> bool:
        with self.lock:
            return self.gone or bool(self.pod["metadata"].get("deletionTimestamp"))

    def _run(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        self.containers = [ContainerRun(c, self.dir / f"{c['name']}.log") for c in self.pod["spec"]["containers"]]
        while not self._prepare():  # a claim is not bound yet
            if self._deleting():
                return self._finalize()
            self._patch({"phase": "Pending", "conditions": [self._cond("PodScheduled", True)]})
            time.sleep(1)
        for cr in self.containers:
            try:
                self._start(cr)
            except Exception as e:  # noqa: BLE001 - reported like a kubelet would
                cr.waiting_reason, cr.waiting_message = "RunContainerError", str(e)
                cr.terminated = {"exitCode": 128, "reason": "StartError", "message": str(e),
                                 "startedAt": now_iso(), "finishedAt": now_iso()}
                cr.waiting_reason = None if policy != "Always" else "CrashLoopBackOff"
                cr.restart_at = time.monotonic() + 10
                log.error("%s/%s: %s cannot start: %s", self.ns, self.pname, cr.name, e)
        while not self._deleting() and not self.node.stopping.is_set():
            for cr in self.containers:
                self._tick_container(cr, policy)
            self._patch(self._status(self._phase(policy)))
            time.sleep(self.TICK)
        self._finalize()

    def _finalize(self) -> None:
        with self.lock:
            grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        grace = min(float(grace), self.node.max_grace_seconds)
        threads = [threading.Thread(target=self._kill, args=(cr, grace)) for cr in self.containers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.node.stopping.is_set() and not self._deleting():
            return  # the node stops: leave the pod object (a fresh node would adopt it)
        if not self.gone:
            try:
                self.api.delete_namespaced_pod(self.pname, self.ns, grace_period_seconds=0,
                                               body={"preconditions": {"uid": self.uid}, "gracePeriodSeconds": 0})
            except Exception as e:  # noqa: BLE001
                if getattr(e, "status", None) not in (404, 409):
                    log.warning("%s/%s: final delete failed: %s", self.ns, self.pname, e)
        log.info("%s/%s: removed", self.ns, self.pname)


# --- the node ----------------------------------------------------------------------------------

class ProcNode:
    """The agent.  ``start()`` runs it in background threads; ``stop()`` kills its pods."""

    def __init__(self, kubeconfig: str, name: str = "proc-0", state_dir: Path | str | None = None,
                 gpus: int = 4, cpu: str = "32", memory: str = "256Gi", ip_subnet: int = 250,
                 apiserver_port: int = 443, share_model_cache: bool = True, max_grace_seconds: float = 30,
                 provision_volumes: bool = True, extra_env: dict[str, str] | None = None,
                 poll_seconds: float = 0.5):
        self.kubeconfig, self.name = kubeconfig, name
        self.state_dir = Path(state_dir or Path(kubeconfig).parent / "procnode" / name)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.gpus, self.cpu, self.memory = gpus, cpu, memory
        self.ip_subnet = ip_subnet
        self.ip_prefix = f"10.244.{ip_subnet}"
        self.loopback_ips = False
        self.apiserver_port = apiserver_port
        self.model_cache = (os.environ.get("KILN_CACHE_DIR") or str(Path.home() / ".cache" / "kiln")) \
            if share_model_cache else None
        self.max_grace_seconds = max_grace_seconds
        self.provision_volumes = provision_volumes
        self.extra_env = dict(extra_env or {})
        self.poll_seconds = poll_seconds
        self.stopping = threading.Event()
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
                r = subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], capture_output=True, text=True)
                if r.returncode == 0:
                    self._ips_used.add(ip)
                    return ip
                if "exists" not in r.stderr:
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
            if not self.loopback_ips:
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
                           "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                         {"type": "Hostname", "address": self.name}],
                           "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
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

    def start(self) -> "ProcNode":
        self.register()
        for fn in (self._heartbeat_loop, self._pods_loop) + ((self._provision_loop,) if self.provision_volumes else ()):
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
        for t in self._threads:
            t.join(timeout=5)
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
    sys.path.insert(0, str(HERE))
    from plane import Plane

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
