"""`helm test` of the installed chart on the test plane: the hook pod
(helm/kiln/templates/tests/test-operator.yaml) runs on the process node, asks the operator's
health port through its Service (``kiln.kiln-system.svc:8080``) and the API server
(``kubernetes.default.svc``) with its ServiceAccount token for the InferenceEngine API; the
node gives Services an address, a proxy and a name (kiln.devcluster.proc_services) as
kube-proxy and the cluster DNS do.  With no ready operator behind the Service the hook fails.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kiln.devcluster.stack import RELEASE, RELEASE_NS

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(600)]

HOOK_POD = f"{RELEASE}-test"
OK_LINE = "the operator answers and the InferenceEngine API is served"


def helm_test(stack) -> subprocess.CompletedProcess:
    return subprocess.run([stack.plane.helm_bin, "test", RELEASE, "--namespace", RELEASE_NS,
                           "--kubeconfig", stack.plane.kubeconfig, "--timeout", "180s"],
                          capture_output=True, text=True, env=stack.plane.env(), timeout=240)


def hook_log(stack, uid: str) -> list[str]:
    """The lines of the hook pod's container log on the node (its pod folder stays after the
    pod is gone).  The node's first lines quote the command: its ``print`` lines are indented
    source there, so a whole line equal to a printed one is the output."""
    found = list((stack.state_dir / "pods").glob(f"{RELEASE_NS}_{HOOK_POD}_{uid[:8]}/test.log"))
    assert len(found) == 1, f"no log of {HOOK_POD} (uid {uid})"
    return found[0].read_text(errors="replace").splitlines()


def hook_uids(stack) -> set[str]:
    """The uids of the hook pods the node ran (from their folders: ``<ns>_<pod>_<uid8>``)."""
    return {p.name.rsplit("_", 1)[1] for p in (stack.state_dir / "pods").glob(f"{RELEASE_NS}_{HOOK_POD}_*")}


def ready_endpoints(stack) -> list[str]:
    out = stack.kubectl("get", "endpointslices", "-n", RELEASE_NS, "-l", f"kubernetes.io/service-name={RELEASE}",
                        "-o", "json")
    return [a for s in json.loads(out)["items"] for ep in s.get("endpoints") or []
            if (ep.get("conditions") or {}).get("ready") for a in ep["addresses"]]


def test_helm_test_passes_and_fails_without_a_ready_operator(stack):
    stack.wait_operator()
    before = hook_uids(stack)
    r = helm_test(stack)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"TEST SUITE:     {HOOK_POD}" in r.stdout and "Phase:          Succeeded" in r.stdout, r.stdout
    (uid8,) = hook_uids(stack) - before  # the hook pod ran on the process node (and was deleted: hook-succeeded)
    log = hook_log(stack, uid8)
    assert log[-3:] == ["/healthz 200", "/readyz 200", OK_LINE], log
    stack.wait_for("the hook pod deleted (hook-succeeded)",
                   lambda: not stack.kubectl("get", "pod", HOOK_POD, "-n", RELEASE_NS, "--ignore-not-found").strip(),
                   stall=60, ns=RELEASE_NS)

    # The Service selects no pod (as when no operator pod is ready): the hook fails.
    component = "app.kubernetes.io/component"
    patch = lambda v: stack.kubectl("patch", "service", RELEASE, "-n", RELEASE_NS, "--type=merge",  # noqa: E731
                                    "-p", json.dumps({"spec": {"selector": {component: v}}}))
    patch("no-such-component")
    try:
        stack.wait_for("the operator's Service without ready endpoints", lambda: not ready_endpoints(stack),
                       stall=60, ns=RELEASE_NS)
        before = hook_uids(stack)
        r = helm_test(stack)
        assert r.returncode != 0, r.stdout + r.stderr
        assert "Phase:          Failed" in r.stdout or "failed" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
        (uid8,) = hook_uids(stack) - before
        log = hook_log(stack, uid8)
        assert "Traceback (most recent call last):" in log and OK_LINE not in log, log
        assert "/healthz 200" not in log and "/readyz 200" not in log, log
        # at the first request: nothing answers behind the Service (here the node's proxy resets
        # the connection; kube-proxy refuses it)
        assert log[-1].startswith(("ConnectionResetError", "ConnectionRefusedError", "urllib.error.URLError",
                                   "http.client.RemoteDisconnected")), log
        pod = json.loads(stack.kubectl("get", "pod", HOOK_POD, "-n", RELEASE_NS, "-o", "json"))
        assert pod["status"]["phase"] == "Failed"  # kept for a look (hook-delete-policy: hook-succeeded)
    finally:
        patch("operator")
        stack.kubectl("delete", "pod", HOOK_POD, "-n", RELEASE_NS, "--ignore-not-found", "--wait=false", check=False)
    stack.wait_for("the operator's Service with its ready endpoint again", lambda: ready_endpoints(stack),
                   stall=60, ns=RELEASE_NS)
