"""The process-backed node itself (kiln.devcluster.procnode), with plain Python commands
instead of the model: exit codes become Job outcomes, PVC mounts map onto host folders,
readiness probes gate EndpointSlices, liveness failures restart, deletion kills."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kiln.devcluster.proc_pod import POD_SITE
from kiln.devcluster.procnode import ProcNode, map_value, pod_log_path

ROOT = Path(__file__).resolve().parents[2]
PY = str(ROOT / ".venv" / "bin" / "python")


def test_map_value():
    m = [("/engines/sub", "/h/s"), ("/engines", "/h/e"), ("/tmp", "/h/t")]
    assert map_value("/engines/abc", m, "10.0.0.2") == "/h/e/abc"
    assert map_value("/engines/sub/x", m, "10.0.0.2") == "/h/s/x"
    assert map_value("--output=/tmp/x", m, "10.0.0.2") == "--output=/h/t/x"
    assert map_value("/tmpfoo", m, "10.0.0.2") == "/tmpfoo"
    assert map_value("0.0.0.0", m, "10.0.0.2") == "10.0.0.2"
    assert map_value("0.0.0.0:8000", m, "10.0.0.2") == "10.0.0.2:8000"


def test_service_names_resolve_with_the_pods_search_path(tmp_path):
    """pod_site/sitecustomize.py resolves the node's Service names (proc_services.py's hosts
    file) as a pod's resolver does: the namespace's search path first for names with fewer
    than five dots; other names as before."""
    hosts = tmp_path / "hosts"
    hosts.write_text("10.244.250.7 kiln.kiln-system.svc.cluster.local\n10.244.250.8 web.team-a.svc.cluster.local\n")
    code = ("import socket, sys\n"
            "for n in sys.argv[1:]:\n"
            "    try:\n"
            "        print(n, socket.getaddrinfo(n, 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])\n"
            "    except OSError:\n"
            "        print(n, 'unresolved')\n")
    names = ["kiln.kiln-system.svc", "kiln.kiln-system", "kiln.kiln-system.svc.cluster.local.", "web", "web.team-a",
             "web.team-a.svc.cluster.local", "kiln", "localhost", "no-such-service.team-a.svc"]
    env = {**os.environ, "PYTHONPATH": str(POD_SITE), "KILN_PROCNODE_HOSTS": str(hosts),
           "KILN_PROCNODE_POD_NAMESPACE": "team-a"}
    out = subprocess.run([PY, "-c", code, *names], env=env, capture_output=True, text=True, check=True).stdout
    got = dict(line.split() for line in out.splitlines())
    assert got == {"kiln.kiln-system.svc": "10.244.250.7", "kiln.kiln-system": "10.244.250.7",
                   "kiln.kiln-system.svc.cluster.local.": "10.244.250.7", "web": "10.244.250.8",
                   "web.team-a": "10.244.250.8", "web.team-a.svc.cluster.local": "10.244.250.8",
                   "kiln": "unresolved", "localhost": "127.0.0.1", "no-such-service.team-a.svc": "unresolved"}


def job(name: str, code: str, volumes=None, mounts=None, args=None) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "volumes": volumes or [],
                "containers": [{"name": "main", "image": "python", "command": ["python3", "-c", code],
                                "args": args or [], "volumeMounts": mounts or []}]}}}}


def job_condition(stack, ns, name):
    j = json.loads(stack.kubectl("get", "job", name, "-n", ns, "-o", "json"))
    return next((c["type"] for c in (j.get("status") or {}).get("conditions") or []
                 if c["status"] == "True" and c["type"] in ("Complete", "Failed")), None)


@pytest.mark.e2e
@pytest.mark.cluster
def test_jobs_pvc_and_exit_codes(stack, ns):
    stack.apply_obj({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
                     "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}, ns)
    vol = [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]
    mnt = [{"name": "data", "mountPath": "/data"}]
    # Paths are mapped where they appear as arguments or env values (not inside code strings).
    stack.apply_obj(job("write", "import os, sys; open(sys.argv[1], 'w').write(os.environ['HOSTNAME'])",
                        vol, mnt, args=["/data/hello"]), ns)
    stack.apply_obj(job("fail", "import sys; print('bye'); sys.exit(3)"), ns)
    assert stack.wait_for("write completes", lambda: job_condition(stack, ns, "write"), ns=ns) == "Complete"
    assert stack.wait_for("fail fails", lambda: job_condition(stack, ns, "fail"), ns=ns) == "Failed"
    pods = {p["metadata"]["labels"]["job-name"]: p for p in stack.pods(ns)}
    term = pods["fail"]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert pods["fail"]["status"]["phase"] == "Failed" and term["exitCode"] == 3
    assert pods["write"]["status"]["phase"] == "Succeeded"
    written = list((stack.state_dir.parent / "volumes").glob(f"{ns}_data_*/hello"))
    assert written and written[0].read_text() == pods["write"]["metadata"]["name"]
    log = pod_log_path(stack.state_dir, ns, pods["fail"]["metadata"]["name"], "main")
    assert log is not None and "bye" in log.read_text()
    # `kubectl logs` goes through the API server to the node's kubelet-like endpoint.
    assert "bye" in stack.kubectl("logs", "-n", ns, pods["fail"]["metadata"]["name"], "-c", "main")


SERVER = """
import http.server, os, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = not os.path.exists(os.environ['SCRATCH'] + '/unready') or self.path != '/ready'
        self.send_response(200 if ok else 503); self.end_headers(); self.wfile.write(b'hi')
    def log_message(self, *a): pass
print('pid', os.getpid(), flush=True)
http.server.ThreadingHTTPServer((sys.argv[1], 8080), H).serve_forever()
"""


@pytest.mark.e2e
@pytest.mark.cluster
def test_probes_endpoints_and_kill_on_delete(stack, ns):
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
           "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                    "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                        "terminationGracePeriodSeconds": 5,
                        "volumes": [{"name": "scratch", "emptyDir": {}}],
                        "containers": [{"name": "web", "image": "python", "command": ["python3", "-c", SERVER],
                                        "args": ["0.0.0.0"], "env": [{"name": "SCRATCH", "value": "/scratch"}], "ports": [{"name": "http", "containerPort": 8080}],
                                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                                        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                                                           "periodSeconds": 1, "failureThreshold": 1}}]}}}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
           "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
    stack.apply_obj(dep, ns)
    stack.apply_obj(svc, ns)
    proxy = stack.proxy("web", ns)
    eps = proxy.wait_endpoints(2, progress=lambda: stack.progress(ns))
    ips = {p["status"]["podIP"] for p in stack.pods(ns)}
    assert {ip for ip, _ in eps} == ips and len(ips) == 2
    import httpx
    assert httpx.get(proxy.url + "/", timeout=5).text == "hi"
    # From a pod: the Service's name (the namespace's search path, port 80 to the pods' "http")
    client = ("import sys, urllib.request\n"
              "for url in sys.argv[1:]:\n"
              "    print(url, urllib.request.urlopen(url, timeout=10).read().decode())\n")
    urls = ["http://web/", f"http://web.{ns}:80/", f"http://web.{ns}.svc.cluster.local/"]
    stack.apply_obj(job("client", client, args=urls), ns)
    assert stack.wait_for("the client job ends", lambda: job_condition(stack, ns, "client"), ns=ns) == "Complete"
    out = pod_log_path(stack.state_dir, ns, stack.pods(ns, "job-name=client")[0]["metadata"]["name"], "main")
    assert [f"{u} hi" for u in urls] == out.read_text().splitlines()[-3:]
    stack.kubectl("delete", "job", "client", "-n", ns, "--cascade=foreground", "--wait=true")

    # A failing readiness probe takes the pod out of the Service, a passing one brings it back.
    pod = stack.pods(ns)[0]
    scratch = stack.state_dir / "pods" / f"{ns}_{pod['metadata']['name']}_{pod['metadata']['uid'][:8]}" / "volumes" / "scratch"
    (scratch / "unready").write_text("")
    stack.wait_for("endpoint removed", lambda: len(proxy.refresh()) == 1, stall=30, interval=0.3, ns=ns)
    (scratch / "unready").unlink()
    stack.wait_for("endpoint back", lambda: len(proxy.refresh()) == 2, stall=30, interval=0.3, ns=ns)

    # Deleting the pods kills their processes.
    pids = [int(c["containerID"].split("://")[1]) for p in stack.pods(ns) for c in p["status"]["containerStatuses"]]
    stack.kubectl("delete", "deployment", "web", "-n", ns, "--wait=true")
    stack.wait_for("pods gone", lambda: not stack.pods(ns), stall=60, interval=0.3, ns=ns)

    def dead(pid):
        try:
            os.kill(pid, 0)
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        except ProcessLookupError:
            return True
    stack.wait_for("processes gone", lambda: all(dead(p) for p in pids), stall=15, interval=0.3, ns=ns)


@pytest.mark.e2e
@pytest.mark.cluster
def test_liveness_failure_restarts_and_crash_loop(stack, ns):
    def dep(name, code, probe=None):
        c = {"name": "main", "image": "python", "command": ["python3", "-c", code]}
        if probe:
            c["livenessProbe"] = probe
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
                "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                         "template": {"metadata": {"labels": {"app": name}}, "spec": {
                             "terminationGracePeriodSeconds": 2, "containers": [c]}}}}
    # Nothing listens on port 9: the liveness probe fails and the container is restarted.
    stack.apply_obj(dep("unlive", "import time; time.sleep(1000)",
                        {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2}), ns)
    stack.apply_obj(dep("crash", "import sys; sys.exit(1)"), ns)

    def status(app):
        pods = stack.pods(ns, f"app={app}")
        return pods[0]["status"]["containerStatuses"][0] if pods and pods[0].get("status", {}).get(
            "containerStatuses") else {}
    stack.wait_for("a liveness restart", lambda: status("unlive").get("restartCount", 0) >= 1, stall=60, interval=0.3, ns=ns)
    crash = stack.wait_for("CrashLoopBackOff", lambda: (status("crash").get("state") or {}).get("waiting", {}).get(
        "reason") == "CrashLoopBackOff" and status("crash"), stall=60, interval=0.3, ns=ns)
    assert crash["lastState"]["terminated"]["exitCode"] == 1


@pytest.mark.e2e
@pytest.mark.cluster
def test_loopback_pod_ips_fallback(stack, ns):
    """A node without CAP_NET_ADMIN hands out 127.0.x.y pod IPs: the EndpointSlice controller
    refuses them, and proc_proxy falls back to the Service's Ready pods."""
    node = ProcNode(stack.plane.kubeconfig, "proc-lo", stack.state_dir.parent / "proc-lo", ip_subnet=251,
                    apiserver_port=stack.plane.state["ports"]["apiserver"], loopback_ips=True,
                    provision_volumes=False).start()
    try:
        dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "lo"},
               "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "lo"}},
                        "template": {"metadata": {"labels": {"app": "lo"}}, "spec": {
                            "nodeSelector": {"kubernetes.io/hostname": "proc-lo"},
                            "terminationGracePeriodSeconds": 2,
                            "containers": [{"name": "web", "image": "python", "command": ["python3", "-c", SERVER],
                                            "args": ["0.0.0.0"], "env": [{"name": "SCRATCH", "value": "/nowhere"}],
                                            "ports": [{"name": "http", "containerPort": 8080}],
                                            "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                                                               "periodSeconds": 1}}]}}}}
        stack.apply_obj(dep, ns)
        stack.apply_obj({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "lo"},
                         "spec": {"selector": {"app": "lo"}, "ports": [{"name": "http", "port": 80,
                                                                        "targetPort": "http"}]}}, ns)
        proxy = stack.proxy("lo", ns)
        eps = proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))
        assert eps[0][0].startswith("127.0.251.") and eps[0][1] == 8080
        import httpx
        assert httpx.get(proxy.url + "/", timeout=5).text == "hi"
        stack.kubectl("delete", "deployment", "lo", "-n", ns, "--wait=true")
        stack.wait_for("pods gone", lambda: not stack.pods(ns), stall=60, interval=0.3, ns=ns)
    finally:
        node.stop()


IN_CLUSTER_CLIENT = """
import os, socket
from kubernetes import client, config
s = socket.socket()
s.bind(("0.0.0.0", 0))
print("bound", s.getsockname()[0], flush=True)
config.load_incluster_config()
ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
pod = client.CoreV1Api().read_namespaced_pod(os.environ['HOSTNAME'], ns)
print("read own pod", pod.metadata.name, "as", pod.spec.service_account_name, flush=True)
try:
    client.CoreV1Api().list_namespaced_secret(ns)
    print("listed secrets", flush=True)
except client.ApiException as e:
    print("secrets refused", e.status, flush=True)
"""


@pytest.mark.e2e
@pytest.mark.cluster
def test_service_account_token_in_cluster_client_and_wildcard_bind(stack, ns):
    """A pod finds its ServiceAccount's projected token where in-cluster clients look (its own
    mount namespace; the host has no token there), authenticates with it and gets exactly the
    account's rights; a wildcard bind() listens on the pod IP, as in a pod's own network."""
    assert stack.node is None or stack.node.mount_namespaces  # this machine can make mount namespaces
    assert not Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists()
    stack.apply_obj({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}}, ns)
    stack.apply_obj({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "pods"},
                     "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]}, ns)
    stack.apply_obj({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                     "metadata": {"name": "reader-pods"},
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
                     "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]}, ns)
    j = job("client", IN_CLUSTER_CLIENT)
    j["spec"]["template"]["spec"]["serviceAccountName"] = "reader"
    stack.apply_obj(j, ns)
    assert stack.wait_for("the client job ends", lambda: job_condition(stack, ns, "client"), ns=ns) == "Complete"
    pod = stack.pods(ns, "job-name=client")[0]
    # The ServiceAccount admission plugin added the projected volume; the node filled it.
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    api_access = next(n for n in vols if n.startswith("kube-api-access-"))
    assert {"serviceAccountToken", "configMap", "downwardAPI"} <= {k for s in vols[api_access]["projected"]["sources"]
                                                                   for k in s}
    out = pod_log_path(stack.state_dir, ns, pod["metadata"]["name"], "main").read_text()
    assert f"bound {pod['status']['podIP']}" in out
    assert f"read own pod {pod['metadata']['name']} as reader" in out
    assert "secrets refused 403" in out
    token = next((stack.state_dir / "pods").glob(f"{ns}_{pod['metadata']['name']}_*/volumes/{api_access}/token"))
    payload = token.read_text().split(".")[1]
    claims = json.loads(__import__("base64").urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["sub"] == f"system:serviceaccount:{ns}:reader"
    assert claims["kubernetes.io"]["pod"]["name"] == pod["metadata"]["name"]  # bound to the pod
