"""One pod of the process-backed node (procnode.py): its volumes mapped onto host folders,
its containers as process groups, its probes, its status, and its deletion.

Test infrastructure; see procnode.py for the node and the rules it follows.
"""

from __future__ import annotations

import base64
import datetime as dt
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
from typing import TYPE_CHECKING, Any

from kiln.devcluster import procs
from kiln.devcluster.paths import VENV_BIN
from kiln.devcluster.proc_volumes import TokenRefresher, mountns_argv, namespace_mounts, write_projected

POD_SITE = Path(__file__).with_name("pod_site")  # put first on the PYTHONPATH of pods' processes

if TYPE_CHECKING:
    from kiln.devcluster.procnode import ProcNode

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


class ContainerConfigError(Exception):
    """The container's configuration cannot be resolved (a missing Secret, ConfigMap or key)."""


def _api_reason(e: Exception) -> str:
    """A kubelet-like one-line reason for an env lookup failure."""
    status, body = getattr(e, "status", None), getattr(e, "body", None)
    if status == 404 and body:
        try:
            import json

            return json.loads(body).get("message") or str(e)
        except ValueError:
            pass
    if isinstance(e, KeyError):
        return f"couldn't find key {e.args[0]} in the referenced object"
    return str(e).splitlines()[0]


def qos_class(pod_spec: dict) -> str:
    """The pod's QoS class as the API server computes it (it refuses a status that says
    otherwise): Guaranteed when every container limits cpu and memory and requests what it
    limits, BestEffort when none requests or limits either, Burstable in between."""
    containers = list(pod_spec.get("initContainers") or []) + list(pod_spec.get("containers") or [])
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for name in ("cpu", "memory"):
            lim, req = limits.get(name), requests.get(name, limits.get(name))
            if lim is not None or req is not None:
                any_set = True
            if lim is None or str(req) != str(lim):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


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
        self.tokens = TokenRefresher()
        self.volume_error: str | None = None  # why a volume cannot be set up yet (retried)

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
            # As the kubelet: a source that cannot be written (no ServiceAccount yet, the
            # namespace's kube-root-ca.crt not published yet) keeps the pod waiting, retried.
            for src in vol["projected"].get("sources") or []:
                try:
                    due = write_projected(self.api, self.pod, src, vdir, self._field)
                except Exception as e:  # noqa: BLE001
                    msg = f"MountVolume.SetUp failed for volume {name!r}: {_api_reason(e)}"
                    if msg != self.volume_error:
                        log.warning("%s/%s: %s", self.ns, self.pname, msg)
                    self.volume_error = msg
                    return None
                if due is not None:
                    self.tokens.add(due, src, vdir)
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

    def _field(self, path: str) -> str:
        meta = self.pod["metadata"]
        return {"metadata.name": self.pname, "metadata.namespace": self.ns, "metadata.uid": self.uid,
                "status.podIP": self.ip, "status.hostIP": "127.0.0.1", "spec.nodeName": self.node.name,
                "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName", "default"),
                }.get(path) or (meta.get("labels") or {}).get(path[len("metadata.labels['"):-2], "")

    def _prepare(self) -> bool:
        """Maps the pod's volumes; False while a claim is not bound yet or a projected source
        cannot be written yet."""
        by_name: dict[str, str] = {}
        self.tokens = TokenRefresher()
        for vol in self.pod["spec"].get("volumes") or []:
            d = self._volume_dir(vol)
            if d is None:
                return False
            by_name[vol["name"]] = d
        self._vols = by_name
        self.volume_error = None
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
        # KUBERNETES_SERVICE_HOST/PORT: what the kubelet sets from the `kubernetes` Service; here
        # the API server itself (pods share the host's network).  KILN_PROCNODE_POD_IP and the
        # PYTHONPATH entry: pod_site/sitecustomize.py binds wildcard listeners to the pod IP.
        env = {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOSTNAME": self.pname, "HOME": str(self.dir / "home"), "LANG": "C.UTF-8",
               "PYTHONUNBUFFERED": "1", "KUBERNETES_SERVICE_HOST": "127.0.0.1",
               "KUBERNETES_SERVICE_PORT": str(self.node.apiserver_port),
               "KUBERNETES_SERVICE_PORT_HTTPS": str(self.node.apiserver_port),
               "KILN_PROCNODE_POD_IP": self.ip, "PYTHONPATH": str(POD_SITE)}
        if self.node.services is not None:  # Service names for Python processes (proc_services.py)
            env["KILN_PROCNODE_HOSTS"] = str(self.node.hosts_file)
            env["KILN_PROCNODE_POD_NAMESPACE"] = self.ns
        if self.node.model_cache:
            env["KILN_CACHE_DIR"] = self.node.model_cache
        env.update(self.node.extra_env)
        # The node's own variables (PATH to the repo's venv, HOME, caches) are host paths: only
        # the container's env is mapped onto its volumes (a repo under /tmp must keep its PATH).
        base, env = env, {}
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
        env = {k: map_value(v, mounts, self.ip) for k, v in env.items()}
        if env.get("PYTHONPATH"):
            env["PYTHONPATH"] = f"{POD_SITE}:{env['PYTHONPATH']}"
        return {**base, **env}

    def _termination_file(self, cr: ContainerRun) -> Path:
        """The host file behind the container's ``terminationMessagePath``."""
        return self.dir / f"{cr.name}.termination-log"

    def _termination_message(self, cr: ContainerRun, rc: int) -> str:
        """What the kubelet reports as the terminated state's message: the container's
        termination file (at most 4096 bytes), or with ``FallbackToLogsOnError`` and a failure,
        the end of its log (2048 bytes, 80 lines)."""
        try:
            text = self._termination_file(cr).read_text(errors="replace")[:4096]
        except OSError:
            text = ""
        if not text.strip() and rc != 0 and cr.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            try:
                text = "\n".join(cr.log_path.read_text(errors="replace").splitlines()[-80:])[-2048:]
            except OSError:
                text = ""
        return text

    def _start(self, cr: ContainerRun) -> None:
        c = cr.spec
        mounts = self._mounts(c)
        if c.get("terminationMessagePath"):  # a file the container may write its cause to, as in a pod
            tfile = self._termination_file(cr)
            tfile.parent.mkdir(parents=True, exist_ok=True)
            tfile.write_text("")
            mounts = sorted(mounts + [(c["terminationMessagePath"], str(tfile))], key=lambda x: -len(x[0]))
        argv = [map_value(a, mounts, self.ip) for a in (c.get("command") or []) + (c.get("args") or [])]
        try:
            env = self._env(c, mounts)
        except Exception as e:  # noqa: BLE001 - a missing Secret/ConfigMap key: the kubelet's config error
            raise ContainerConfigError(_api_reason(e)) from e
        Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
        if not argv:
            raise RuntimeError("container has no command (image entrypoints are unknown here)")
        exe = shutil.which(argv[0], path=env["PATH"]) if "/" not in argv[0] else argv[0]
        if exe is None:
            raise FileNotFoundError(f"{argv[0]}: not found on {env['PATH']}")
        cwd = map_value(c["workingDir"], mounts, self.ip) if c.get("workingDir") else str(self.dir)
        cmd = [exe, *argv[1:]]
        ns_mounts = namespace_mounts(c, self._vols) if self.node.mount_namespaces else []
        cr.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(cr.log_path, "ab") as out:
            mounted = "".join(f" [{dst} <- {host}]" for host, dst, _ in ns_mounts)
            out.write(f"--- {now_iso()} procnode: {shlex.join(cmd)}{mounted}\n".encode())
            out.flush()
            # The well-known mounts (the service-account token) in the container's own mount namespace.
            cr.proc = procs.spawn(mountns_argv(ns_mounts, cmd, sys.executable),
                                  what=f"pod {self.ns}/{self.pname}: {cr.name}", bind=True,
                                  env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
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
        procs.forget(p.pid)

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
            message = self._termination_message(cr, rc)
            if message:
                cr.terminated["message"] = message
            cr.ready = False
            log.info("%s/%s: %s exited with %d", self.ns, self.pname, cr.name, rc)
            if policy == "Always" or (policy == "OnFailure" and rc != 0):
                cr.last_state = {"terminated": cr.terminated}
                backoff = min(10 * 2 ** cr.restart_count, 300) if now - cr.run_started < 600 else 10
                cr.restart_at = now + backoff
                cr.waiting_reason = "CrashLoopBackOff"
                cr.waiting_message = f"back-off {backoff}s restarting failed container"
                cr.restart_count += 1
        if cr.waiting_reason in ("CrashLoopBackOff", "CreateContainerConfigError") and now >= cr.restart_at:
            self._try_start(cr, policy)
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
            "qosClass": qos_class(self.pod["spec"]),
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
        while not self._prepare():  # a claim is not bound yet, a projected source not ready
            if self._deleting():
                return self._finalize()
            self._patch({"phase": "Pending", "conditions": [self._cond("PodScheduled", True)]})
            time.sleep(1)
        for cr in self.containers:
            self._try_start(cr, policy)
        while not self._deleting() and not self.node.stopping.is_set():
            for cr in self.containers:
                self._tick_container(cr, policy)
            self.tokens.refresh(self.api, self.pod, lambda m: log.warning("%s/%s: %s", self.ns, self.pname, m))
            self._patch(self._status(self._phase(policy)))
            time.sleep(self.TICK)
        self._finalize()

    def _try_start(self, cr: ContainerRun, policy: str) -> None:
        """Start a container, reporting a failure as the kubelet does: a missing Secret or
        ConfigMap key waits as ``CreateContainerConfigError`` (retried, no restart counted),
        anything else is a start error."""
        try:
            self._start(cr)
        except ContainerConfigError as e:
            cr.waiting_reason, cr.waiting_message = "CreateContainerConfigError", str(e)
            cr.restart_at = time.monotonic() + 2
            log.error("%s/%s: %s: %s", self.ns, self.pname, cr.name, e)
        except Exception as e:  # noqa: BLE001 - reported like a kubelet would
            cr.waiting_reason, cr.waiting_message = "RunContainerError", str(e)
            cr.terminated = {"exitCode": 128, "reason": "StartError", "message": str(e),
                             "startedAt": now_iso(), "finishedAt": now_iso()}
            cr.waiting_reason = None if policy != "Always" else "CrashLoopBackOff"
            cr.restart_at = time.monotonic() + 10
            log.error("%s/%s: %s cannot start: %s", self.ns, self.pname, cr.name, e)

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
