"""The chart's router (helm/kiln/templates/router.yaml): values schema, least-privilege RBAC
matched to the API calls of kiln.operator.router, rendered flags accepted by the real
`kiln router` parser, each scope, and the off switch."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from kiln.operator.router.config import parse_args
from test_chart import CHART, HELM, render

needs_helm = pytest.mark.skipif(HELM is None, reason="no helm binary (bash devcluster/build.sh builds one)")

# Every API call of the router: reflectors list + watch InferenceEngines and EndpointSlices
# (discovery.py); the activity signal merge-patches an InferenceEngine (activity.py).
NEEDED = {("kiln.dev", "inferenceengines", "list"), ("kiln.dev", "inferenceengines", "watch"),
          ("kiln.dev", "inferenceengines", "patch"),
          ("discovery.k8s.io", "endpointslices", "list"), ("discovery.k8s.io", "endpointslices", "watch")}


def router_rules():
    text = (CHART / "templates/_helpers.tpl").read_text()
    block = text.split('{{- define "kiln.routerRules" -}}', 1)[1].split("{{- end -}}", 1)[0]
    return yaml.safe_load(block)


def test_router_rbac_is_exactly_what_the_router_uses():
    granted = {(g, r, v) for rule in router_rules() for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert granted == NEEDED


def test_router_values_validate_and_typos_fail():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    for bad in ({"enabled": True, "polcy": "prefix"}, {"enabled": True, "policy": "random"},
                {"enabled": True, "loadFactor": 1.0}, {"enabled": True, "holdTimeoutSeconds": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**values, "router": bad}, schema)


def router_docs(docs):
    return {d["kind"]: d for d in docs if d["metadata"]["name"] == "kiln-router"}


@needs_helm
def test_router_renders_with_flags_the_router_accepts():
    docs = router_docs(render("router.policy=least-outstanding", "router.holdTimeoutSeconds=45"))
    assert {"ServiceAccount", "Service", "Deployment", "ClusterRole", "ClusterRoleBinding"} <= set(docs)
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    assert ctr["command"] == ["kiln", "router"] and pod["serviceAccountName"] == "kiln-router"
    cfg = parse_args(ctr["args"])  # the real parser: every rendered flag exists
    assert cfg.policy == "least-outstanding" and cfg.hold_timeout_seconds == 45 and cfg.namespaces == ()
    assert ctr["image"].startswith("ghcr.io/kiln-dev/kiln-operator:")  # the operator image has `kiln router`
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/ready" and ctr["securityContext"]["readOnlyRootFilesystem"]
    svc = docs["Service"]
    assert svc["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    rules = docs["ClusterRole"]["rules"]
    assert {(g, r, v) for x in rules for g in x["apiGroups"] for r in x["resources"] for v in x["verbs"]} == NEEDED
    subject = docs["ClusterRoleBinding"]["subjects"][0]
    assert subject["name"] == "kiln-router" and subject["namespace"] == "kiln-system"
    operator = next(d for d in render() if d["kind"] == "Deployment" and d["metadata"]["name"] == "kiln")
    assert operator["spec"]["selector"]["matchLabels"] != svc["spec"]["selector"]  # never selects the operator


@needs_helm
def test_router_namespace_scope_and_off_switch():
    docs = render("watchNamespaces={team-a,team-b}")
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kiln-router"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert not [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "kiln-router"]
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kiln-router")
    assert parse_args(dep["spec"]["template"]["spec"]["containers"][0]["args"]).namespaces == ("team-a", "team-b")
    off = render("router.enabled=false")
    assert not [d for d in off if "router" in d["metadata"]["name"]]


@needs_helm
def test_operator_finds_the_router_pods_for_the_router_queue_signal():
    """autoscaling.metric routerQueue: the operator's rendered --router-selector (its real parser)
    selects exactly the router's pods, it may list them in each scope, and the chart's monitors
    scrape the router keeping its own namespace label (honorLabels)."""
    from kiln.operator.main import parse_args as operator_args
    for scope in ((), ("watchNamespaces={team-a}",)):
        docs = render(*scope, "metrics.podMonitor.enabled=true", "metrics.serviceMonitor.enabled=true")
        op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kiln")
        opts = operator_args(op["spec"]["template"]["spec"]["containers"][0]["args"])
        labels = router_docs(docs)["Deployment"]["spec"]["template"]["metadata"]["labels"]
        wanted = dict(kv.split("=", 1) for kv in opts.router_selector.split(","))
        assert wanted and wanted.items() <= labels.items() and wanted["app.kubernetes.io/component"] == "router"
        assert opts.build_progress_seconds == 10
        monitors = [d for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor") and d["metadata"]["name"] == "kiln-router"]
        assert len(monitors) == 2
        for m in monitors:
            assert m["spec"]["selector"]["matchLabels"] == wanted
            ends = m["spec"].get("podMetricsEndpoints") or m["spec"]["endpoints"]
            assert ends[0]["honorLabels"] is True and ends[0]["path"] == "/metrics"
        if scope:  # namespaced: a Role in the release namespace lets the operator list the router's pods
            role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kiln-router-pods")
            assert role["metadata"]["namespace"] == "kiln-system"
            assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]
    off = render("router.enabled=false")
    op = next(d for d in off if d["kind"] == "Deployment" and d["metadata"]["name"] == "kiln")
    assert operator_args(op["spec"]["template"]["spec"]["containers"][0]["args"]).router_selector == ""
