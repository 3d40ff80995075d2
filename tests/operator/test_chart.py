"""The Helm chart: single-sourced CRD, strict values schema, least-privilege RBAC, and
(when a helm binary is available) rendering in each mode."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kiln"


def helm_bin():
    for cand in (os.environ.get("HELM"), shutil.which("helm")):
        if cand and os.access(cand, os.X_OK):
            return cand
    r = subprocess.run(["bash", str(ROOT / "devcluster/build.sh"), "--print"], capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        cand = Path(r.stdout.strip().splitlines()[-1]) / "helm"
        if cand.exists():
            return str(cand)
    return None


def test_chart_crd_is_the_repository_crd():
    assert (CHART / "files/crds/inferenceengine.yaml").read_bytes() == (ROOT / "crds/inferenceengine.yaml").read_bytes(), \
        "run: cp crds/inferenceengine.yaml helm/kiln/files/crds/"


def test_values_validate_against_the_strict_schema():
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    for bad in ({**values, "replicaCont": 2}, {**values, "rbac": {"scope": "everything"}},
                {**values, "crds": {"instal": True}}, {**values, "metrics": {"serviceMonitor": {"enabled": True, "x": 1}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def chart_rules():
    text = (CHART / "templates/_helpers.tpl").read_text()
    block = text.split('{{- define "kiln.rules" -}}', 1)[1].split("{{- end -}}", 1)[0]
    return yaml.safe_load(block)


# Every API call the operator makes (kiln.operator.reconcile/controller/leader) and kopf's watches.
NEEDED = {
    ("kiln.dev", "inferenceengines", "list"), ("kiln.dev", "inferenceengines", "watch"),
    ("kiln.dev", "inferenceengines/status", "patch"),
    ("apps", "deployments", "get"), ("apps", "deployments", "patch"), ("apps", "deployments", "create"),
    ("apps", "deployments", "list"), ("apps", "deployments", "watch"),
    ("batch", "jobs", "list"), ("batch", "jobs", "watch"), ("batch", "jobs", "create"), ("batch", "jobs", "patch"),
    ("batch", "jobs", "delete"),
    ("autoscaling", "horizontalpodautoscalers", "create"), ("autoscaling", "horizontalpodautoscalers", "patch"),
    ("autoscaling", "horizontalpodautoscalers", "delete"),
    ("", "services", "create"), ("", "services", "patch"),
    ("", "configmaps", "get"), ("", "configmaps", "create"), ("", "configmaps", "patch"),
    ("", "persistentvolumeclaims", "get"), ("", "persistentvolumeclaims", "create"),
    ("", "pods", "list"), ("", "pods", "watch"), ("", "events", "create"), ("", "events", "patch"),
}


def test_rbac_is_exactly_what_the_operator_uses():
    granted = {(g, r, v) for rule in chart_rules() for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert NEEDED <= granted
    assert not any(r == "*" or v == "*" for _, r, v in granted)
    assert not any(r in ("secrets", "nodes", "clusterroles", "roles") for _, r, _ in granted)
    extra = granted - NEEDED
    # reads that SSA and kopf need besides the list above
    assert extra <= {("kiln.dev", "inferenceengines", "get"), ("kiln.dev", "inferenceengines/status", "get"),
                     ("batch", "jobs", "get"), ("autoscaling", "horizontalpodautoscalers", "get"),
                     ("", "services", "get"), ("", "services", "patch"), ("", "persistentvolumeclaims", "patch"),
                     ("", "pods", "get")}, extra


HELM = helm_bin()
needs_helm = pytest.mark.skipif(HELM is None, reason="no helm binary (bash devcluster/build.sh builds one)")


def render(*sets, namespace="kiln-system"):
    args = [HELM, "template", "kiln", str(CHART), "--namespace", namespace, "--kube-version", "1.36.0"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@needs_helm
def test_lint():
    r = subprocess.run([HELM, "lint", str(CHART), "--strict", "--kube-version", "1.36.0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_helm
def test_cluster_scope_render():
    docs = render()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("CustomResourceDefinition", "inferenceengines.kiln.dev") in kinds
    assert ("ClusterRole", "kiln") in kinds and ("ClusterRoleBinding", "kiln") in kinds
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    src = yaml.safe_load((ROOT / "crds/inferenceengine.yaml").read_text())
    assert crd["spec"] == src["spec"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] and ctr["securityContext"]["readOnlyRootFilesystem"]
    assert ctr["resources"]["limits"]["memory"] and ctr["livenessProbe"] and ctr["readinessProbe"]
    assert "--all-namespaces" in ctr["args"]


@needs_helm
def test_namespace_scope_render():
    docs = render("rbac.scope=namespace", "watchNamespaces={team-a,team-b}", "crds.keep=false")
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kiln"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


@needs_helm
def test_cluster_scope_with_namespaces_renders_roles_not_a_cluster_role():
    """watchNamespaces with rbac.scope=cluster is not ignored: Roles in those namespaces only."""
    docs = render("watchNamespaces={team-a}")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kiln"]
    assert [r["metadata"]["namespace"] for r in roles] == ["team-a"]
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args


@needs_helm
def test_optional_pieces_render():
    docs = render("crds.install=false", "metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true",
                  "metrics.prometheusAdapterRule.enabled=true")
    kinds = {d["kind"] for d in docs}
    assert "CustomResourceDefinition" not in kinds
    assert {"ServiceMonitor", "PodMonitor", "ConfigMap"} <= kinds
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]["custom"]
    assert rules[0]["name"]["as"] == "kiln_request_queue_time_seconds"


@needs_helm
def test_typo_in_values_fails_the_render():
    r = subprocess.run([HELM, "template", "kiln", str(CHART), "--kube-version", "1.36.0", "--set", "replicaCont=2"], capture_output=True, text=True)
    assert r.returncode != 0 and "replicaCont" in r.stderr
