"""The real metrics pipeline of the HPA mode on a test plane: Prometheus scraping the serving pods
and prometheus-adapter serving ``custom.metrics.k8s.io`` from it with the chart's rules.

- ``Prometheus``: the Debian package's ``prometheus`` binary scraping ``<podIP>:8000/metrics``
  of Kiln's Running serving pods, with the ``namespace`` and ``pod`` labels that the
  prometheus-adapter rule maps to resources (what the chart's PodMonitor gives on a real
  cluster).  Debian builds Prometheus without ``kubernetes_sd_configs``, so the pods are
  discovered here: a thread lists them from the plane's API server every second and rewrites a
  ``file_sd_configs`` target file, which Prometheus watches.
- ``PrometheusAdapter``: prometheus-adapter built from source (devcluster/build.sh
  prometheus-adapter) with the rules of the chart's ConfigMap (helm/kiln/templates/
  prometheus-adapter-rule.yaml, rendered by ``helm template``), serving TLS with the plane's
  custom-metrics serving certificate; ``use()`` points the plane's APIService
  ``v1beta2.custom.metrics.k8s.io`` at it (``restore()`` back at the plane's stand-in).

Both run as bound process groups (``kiln.devcluster.procs``): they end with the test run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from kiln.devcluster import procs
from kiln.devcluster.paths import BUILD_SH, REPO
from kiln.devcluster.plane import Plane, free_ports

__all__ = ["prometheus_bin", "adapter_bin", "Prometheus", "PrometheusAdapter", "chart_adapter_rules"]

APISERVICE = "v1beta2.custom.metrics.k8s.io"


def prometheus_bin() -> str | None:
    """The ``prometheus`` binary (Debian package ``prometheus``), or None."""
    return shutil.which("prometheus") or next((p for p in ("/usr/bin/prometheus",) if Path(p).exists()), None)


def adapter_bin() -> str | None:
    """The cached prometheus-adapter binary (``build.sh prometheus-adapter --print``), or None."""
    r = subprocess.run(["bash", str(BUILD_SH), "prometheus-adapter", "--print"], capture_output=True, text=True)
    path = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
    return path if path and Path(path).exists() else None


def chart_adapter_rules(helm: str, rate_window: str) -> list[dict]:
    """The ``rules.custom`` of the chart's prometheus-adapter ConfigMap, rendered by helm with
    ``metrics.prometheusAdapterRule.rateWindow=rate_window``."""
    from kiln.devcluster.crds import versions
    r = subprocess.run([helm, "template", "kiln", str(REPO / "helm/kiln"), "--kube-version", versions()["K8S_VERSION"],
                        "--show-only",
                        "templates/prometheus-adapter-rule.yaml", "--set", "metrics.prometheusAdapterRule.enabled=true",
                        "--set", f"metrics.prometheusAdapterRule.rateWindow={rate_window}"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"helm template failed: {r.stderr.strip()[-500:]}")
    cm = yaml.safe_load(r.stdout)
    return yaml.safe_load(cm["data"]["config.yaml"])["rules"]["custom"]


class Prometheus:
    """A Prometheus process scraping Kiln's serving pods on ``plane`` every ``scrape_s`` (whole) seconds."""

    def __init__(self, plane: Plane, folder: Path, scrape_s: int = 1):
        self.plane, self.dir, self.scrape_s = plane, Path(folder), scrape_s
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets_file = self.dir / "targets.json"
        self.proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._discover_loop, daemon=True, name="prometheus-discovery")

    def config(self) -> dict:
        """prometheus.yml: one job scraping the targets of ``targets_file`` on ``/metrics``."""
        return {"global": {"scrape_interval": f"{self.scrape_s}s", "scrape_timeout": f"{self.scrape_s}s"},
                "scrape_configs": [{"job_name": "kiln-engines", "metrics_path": "/metrics",
                                    "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}]}]}

    def targets(self) -> list[dict]:
        """file_sd target groups: each Running serving pod of an InferenceEngine with an IP, at
        ``<podIP>:8000``, labelled with its ``namespace`` and ``pod``."""
        out = self.plane.kubectl("get", "pods", "-A", "-l", "app.kubernetes.io/name=kiln-engine,"
                                 "app.kubernetes.io/component=server", "-o", "json", check=False)
        groups = []
        for pod in json.loads(out or '{"items": []}')["items"]:
            st, meta = pod.get("status") or {}, pod["metadata"]
            if st.get("phase") == "Running" and st.get("podIP") and not meta.get("deletionTimestamp"):
                groups.append({"targets": [f"{st['podIP']}:8000"],
                               "labels": {"namespace": meta["namespace"], "pod": meta["name"]}})
        return groups

    def discover(self) -> None:
        """Rewrite the target file from the plane's pods (atomically: Prometheus never reads half)."""
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.targets()))
        os.replace(tmp, self.targets_file)

    def _discover_loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.discover()
            except Exception:  # noqa: BLE001 - the plane busy: the next round retries
                pass

    def start(self, binary: str) -> "Prometheus":
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config()))
        self.discover()
        self._thread.start()
        logf = open(self.dir / "prometheus.log", "ab")
        self.proc = procs.spawn([binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.dir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                                what="prometheus", bind=True, stdout=logf, stderr=logf)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict]:
        """The result vector of an instant query."""
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=5) as r:
            return json.loads(r.read())["data"]["result"]

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None:
            procs.stop_group(self.proc.pid)
            procs.forget(self.proc.pid)
            self.proc = None


class PrometheusAdapter:
    """prometheus-adapter serving ``custom.metrics.k8s.io`` for ``plane`` from ``prometheus_url``
    with ``rules`` (prometheus-adapter's ``rules`` config entries)."""

    def __init__(self, plane: Plane, folder: Path, prometheus_url: str, rules: list[dict]):
        self.plane, self.dir, self.prometheus_url, self.rules = plane, Path(folder), prometheus_url, rules
        self.port = free_ports(1)[0]
        self.proc: subprocess.Popen | None = None

    def start(self, binary: str) -> "PrometheusAdapter":
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "adapter-config.yaml"
        cfg.write_text(yaml.safe_dump({"rules": self.rules}))
        kc, pki = str(self.plane.dir / "custom-metrics.kubeconfig"), self.plane.pki
        logf = open(self.dir / "prometheus-adapter.log", "ab")
        self.proc = procs.spawn([
            binary, f"--config={cfg}", f"--prometheus-url={self.prometheus_url}", "--metrics-relist-interval=2s",
            f"--lister-kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={self.port}",
            f"--tls-cert-file={pki / 'custom-metrics-serving.crt'}",
            f"--tls-private-key-file={pki / 'custom-metrics-serving.key'}", f"--cert-dir={self.dir / 'certs'}", "--v=2"],
            what="prometheus-adapter", bind=True, stdout=logf, stderr=logf)
        return self

    def _point(self, port: int) -> None:
        """The plane's custom-metrics Service and APIService on ``port`` of 127.0.0.1."""
        from kiln.devcluster import pki
        ns, svc = pki.METRICS_NAMESPACE, pki.METRICS_SERVICE
        self.plane.kubectl("patch", "service", svc, "-n", ns, "--type=json", "-p", json.dumps(
            [{"op": "replace", "path": "/spec/ports/0/port", "value": port}]))
        self.plane.kubectl("patch", "apiservice", APISERVICE, "--type=merge", "-p", json.dumps(
            {"spec": {"service": {"port": port}}}))

    def use(self) -> None:
        """Serve the plane's custom metrics API from this adapter; the HPA controller's
        ServiceAccount may read it (the adapter authorizes every request)."""
        self.plane.apply([
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "kiln-plane-custom-metrics-reader"},
             "rules": [{"apiGroups": ["custom.metrics.k8s.io"], "resources": ["*"], "verbs": ["get", "list"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "kiln-plane-custom-metrics-reader"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": "kiln-plane-custom-metrics-reader"},
             "subjects": [{"kind": "ServiceAccount", "name": "horizontal-pod-autoscaler", "namespace": "kube-system"}]}])
        self._point(self.port)

    def restore(self) -> None:
        """Back to the plane's stand-in custom metrics server."""
        self._point(self.plane.state["ports"]["custom_metrics"])

    def available(self) -> bool:
        out = self.plane.kubectl("get", "apiservice", APISERVICE, "-o", "json", check=False)
        conds = json.loads(out or "{}").get("status", {}).get("conditions", [])
        return any(c["type"] == "Available" and c["status"] == "True" for c in conds)

    def pods_metric(self, namespace: str, metric: str) -> list[dict]:
        """``kubectl get --raw`` of ``metric`` for every pod of ``namespace`` (through the
        aggregator, as the HPA controller reads it); empty when not served yet."""
        out = self.plane.kubectl("get", "--raw", f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{namespace}"
                                 f"/pods/*/{metric}", check=False)
        try:
            return json.loads(out or "{}").get("items") or []
        except ValueError:
            return []

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop_group(self.proc.pid)
            procs.forget(self.proc.pid)
            self.proc = None
