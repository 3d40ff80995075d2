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
    ("", "configmaps", "list"), ("", "configmaps", "delete"),  # engine records: the cache lifecycle
    ("", "persistentvolumeclaims", "get"), ("", "persistentvolumeclaims", "create"),
    ("", "pods", "list"), ("", "pods", "watch"), ("", "pods/log", "get"), ("", "events", "create"), ("", "events", "patch"),
    # the API key named by runtime.apiKeySecretRef, for the pods' LoRA load/unload calls: get by
    # name only (no list, no watch)
    ("", "secrets", "get"),
    # spec.gateway (HTTPRoute, InferencePool, the endpoint picker) and mode keda (ScaledObject)
    *{(g, r, v) for g, r in (("gateway.networking.k8s.io", "httproutes"), ("inference.networking.k8s.io", "inferencepools"),
                             ("keda.sh", "scaledobjects")) for v in ("create", "patch", "delete")},
    # the endpoint picker's (deleted with its InferencePool: no delete right)
    ("", "serviceaccounts", "create"), ("", "serviceaccounts", "patch"),
    ("rbac.authorization.k8s.io", "rolebindings", "create"), ("rbac.authorization.k8s.io", "rolebindings", "patch"),
    ("rbac.authorization.k8s.io", "clusterroles", "bind"), ("rbac.authorization.k8s.io", "roles", "bind"),
}


def test_rbac_is_exactly_what_the_operator_uses():
    granted = {(g, r, v) for rule in chart_rules() for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert NEEDED <= granted
    assert not any(r == "*" or v == "*" for _, r, v in granted)
    assert not any(r == "nodes" for _, r, _ in granted)
    assert {v for _, r, v in granted if r in ("clusterroles", "roles")} == {"bind"}  # only the chart's picker role
    binds = [rule for rule in chart_rules() if {"clusterroles", "roles"} & set(rule["resources"])]
    assert binds and all(rule.get("resourceNames") == ['{{ include "kiln.fullname" . }}-endpoint-picker']
                         for rule in binds)
    assert {v for _, r, v in granted if r == "secrets"} == {"get"}
    extra = granted - NEEDED
    # reads that SSA and kopf need besides the list above
    assert extra <= {("kiln.dev", "inferenceengines", "get"), ("kiln.dev", "inferenceengines/status", "get"),
                     ("batch", "jobs", "get"), ("autoscaling", "horizontalpodautoscalers", "get"),
                     ("", "services", "get"), ("", "services", "patch"), ("", "persistentvolumeclaims", "patch"),
                     ("", "pods", "get"), ("gateway.networking.k8s.io", "httproutes", "get"),
                     ("inference.networking.k8s.io", "inferencepools", "get"), ("keda.sh", "scaledobjects", "get"),
                     ("", "serviceaccounts", "get"), ("rbac.authorization.k8s.io", "rolebindings", "get")}, extra


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


def _dashboard_metrics():
    dash = json.loads((CHART / "files/grafana/kiln-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return dash, exprs, set(re.findall(r"\b(kiln_[a-z_]+?)(?:_bucket|_sum|_count)?\{", " ".join(exprs)))


def test_argocd_health_and_dashboard_files_are_the_sources():
    from kiln.common.metrics import METRIC_NAMES, METRICS

    dash, exprs, used = _dashboard_metrics()
    assert used and used <= set(METRIC_NAMES), used - set(METRIC_NAMES)
    kinds = {m.name: m.type for m in METRICS}
    for e in exprs:  # histograms are read through their buckets / sums, counters through rate()
        for name in re.findall(r"\b(kiln_[a-z_]+?)(_bucket|_sum|_count)?\{", e):
            if kinds[name[0]] == "histogram":
                assert name[1], e
            if kinds[name[0]] == "counter" or name[1]:
                assert "rate(" in e, e
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for what in ("tokens / s", "time to first token", "time per output token", "queue time", "kv cache", "replicas"):
        assert what in titles, what


@needs_helm
def test_helm_test_hook_dashboard_and_argocd_snippet_render():
    docs = render("grafana.dashboard.enabled=true", "grafana.dashboard.namespace=monitoring",
                  "argocd.healthCheck.enabled=true", "argocd.healthCheck.namespace=argocd")
    test = next(d for d in docs if d["kind"] == "Pod")
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = test["spec"]["containers"][0]["args"][0]
    assert "http://kiln.kiln-system.svc:8080" in script and "/apis/kiln.dev/v1alpha1" in script
    compile(script, "helm-test", "exec")  # the test's Python parses
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "kiln")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    dash = cms["kiln-grafana-dashboard"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1" and dash["metadata"]["namespace"] == "monitoring"
    assert json.loads(dash["data"]["kiln-dashboard.json"]) == json.loads((CHART / "files/grafana/kiln-dashboard.json").read_text())
    argo = cms["kiln-argocd-health"]
    assert argo["metadata"]["namespace"] == "argocd"
    assert argo["data"]["resource.customizations.health.kiln.dev_InferenceEngine"].strip() == \
        (CHART / "files/argocd-health.lua").read_text().strip()
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--engine-gc-seconds=300", "--engine-retention-seconds=604800", "--engine-cache-min-free=0"} <= set(args)
    from kiln.operator.main import parse_args
    opts = parse_args([a for a in args if a.startswith("--engine")])  # the flags exist in the operator's parser
    assert opts.engine_retention_seconds == 604800 and opts.engine_gc_seconds == 300
    assert not [d for d in render("tests.enabled=false") if d["kind"] == "Pod"]


@needs_helm
def test_adapter_rules_and_endpoint_picker_role_render():
    docs = render("metrics.prometheusAdapterRule.enabled=true", "metrics.prometheusAdapterRule.rateWindow=30s")
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("prometheus-adapter-rules"))
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]["custom"]
    served = {(r.get("name") or {}).get("as") or r["seriesQuery"].split("{")[0] for r in rules}
    assert served == {"kiln_request_queue_time_seconds", "kiln_time_to_first_token_seconds",
                      "kiln_kv_cache_usage_ratio", "kiln_num_requests_waiting"}
    assert all("[30s]" in r["metricsQuery"] for r in rules if "rate(" in r["metricsQuery"])
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "kiln-endpoint-picker")
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--endpoint-picker-role=ClusterRole/kiln-endpoint-picker" in args
    ns_docs = render("rbac.scope=namespace")
    assert not [d for d in ns_docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert [d for d in ns_docs if d["kind"] == "Role" and d["metadata"]["name"] == "kiln-endpoint-picker"]
    assert {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
        ("inference.networking.x-k8s.io", "inferenceobjectives")}
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in role["rules"])


@needs_helm
@pytest.mark.parametrize("sets", [(), ("rbac.scope=namespace",), ("watchNamespaces={a,b}",)])
def test_operator_args_parse_with_the_real_cli_and_name_the_rendered_picker_role(sets):
    from kiln.operator.main import parse_args
    docs = render(*sets)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    opts = parse_args(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    kind, name = opts.endpoint_picker_role
    assert [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name], (kind, name)
