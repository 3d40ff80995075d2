"""spec.gateway and the autoscaling signals: the parsed spec, the pure builders (HTTPRoute,
InferencePool, its endpoint picker, HPA per signal, KEDA ScaledObject) and the plan with the
optional APIs served or not (discovery's answer comes in as ``Observed.served``)."""

import re
from pathlib import Path

import pytest

from kiln.common.enginespec import EngineSpecError
from kiln.devcluster.fixtures import skip_or_fail_in_ci
from kiln.operator import builders as b
from kiln.operator import builders_autoscaling as ba
from kiln.operator import builders_gateway as bg
from kiln.operator import constants as c
from kiln.operator.autoscaler import BuiltinAutoscaler
from kiln.operator.exposure import OPTIONAL_KINDS, ROUTE, SCALED
from kiln.operator.plan import ChildRef, Observed, plan
from kiln.operator.scaling_metrics import SCALING_METRICS
from kiln.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
NOW = "2026-01-02T03:04:05Z"
OWNER = {"name": "smollm2", "namespace": "team-a", "uid": "u-1"}
BASE = {"model": {"builtin": "smollm2-135m-instruct"}}
GW = {"httpRoute": {"parentRefs": [{"name": "inference-gw", "namespace": "gateways", "sectionName": "http"}],
                    "hostnames": ["llm.example.com"]},
      "inferencePool": {"enabled": True}}
ALL = frozenset(OPTIONAL_KINDS)


def spec(**changes):
    return parse_spec({**BASE, **changes})


def served_plan(s, served=ALL, status=None, built=True, pool_uid="pool-uid"):
    h = s.engine_hash
    rec = {"metadata": {"name": b.record_name("kiln-engine-cache", h)}, "data": {"engineHash": h}} if built else None
    return plan(s, Observed(owner=OWNER, generation=1, claim_exists=True, record=rec, served=served,
                            status=status or {}, pool_uid=pool_uid), NOW, epp_role=("Role", "kiln-endpoint-picker"))


def conds(p):
    return {x["type"]: (x["status"], x["reason"]) for x in p.status["conditions"]}


# --- spec -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("gateway, message", [
    ({"httpRoute": {"parentRefs": []}}, "parentRefs"),
    ({"httpRoute": {"parentRefs": [{"namespace": "x"}]}}, "parentRefs[0].name"),
    ({"httpRoute": {"parentRefs": [{"name": "g"}], "pathPrefix": "v1"}}, "pathPrefix"),
    ({"httpRoute": {"parentRefs": [{"name": "g"}], "hostnames": ["ok.example.com", "Bad_Host!"]}}, "hostnames[1]"),
    ({"httpRoute": {"parentRefs": [{"name": "g"}], "hostnames": ["a." * 127 + "b"]}}, "hostnames[0]"),
    ({"inferencePool": {"enabled": True, "endpointPicker": {"deploy": False}}}, "serviceName"),
    ({"inferencePool": {"enabled": True, "endpointPicker": {"failureMode": "Open"}}}, "failureMode"),
])
def test_gateway_spec_errors_name_the_field(gateway, message):
    with pytest.raises(EngineSpecError, match=re.escape(message)):
        spec(gateway=gateway)


def test_gateway_hostnames_of_the_gateway_api_pass():
    hosts = ("*.example.com", "llm.internal", "a-b.c9")
    route = {"parentRefs": [{"name": "g"}], "hostnames": list(hosts)}
    assert spec(gateway={"httpRoute": route}).gateway.http_route.hostnames == hosts


@pytest.mark.parametrize("autoscaling, message", [
    ({"mode": "keda"}, "keda.serverAddress"),
    ({"mode": "keda", "keda": {"serverAddress": "prometheus:9090"}}, "is not a Prometheus URL"),
    ({"mode": "hpa", "metric": "gpuUtil"}, "autoscaling.metric"),
    ({"mode": "hpa", "metric": "kvCacheUsage", "target": 1.5}, "autoscaling.target"),
])
def test_autoscaling_spec_errors_name_the_field(autoscaling, message):
    with pytest.raises(EngineSpecError, match=re.escape(message)):
        spec(autoscaling=autoscaling)


def test_target_defaults_per_signal():
    assert spec(autoscaling={"mode": "hpa", "targetQueueTimeSeconds": 0.25}).autoscaling.target_value == 0.25
    assert spec(autoscaling={"mode": "hpa", "metric": "kvCacheUsage"}).autoscaling.target_value == 0.8
    assert spec(autoscaling={"mode": "hpa", "metric": "waitingRequests", "target": 2}).autoscaling.target_value == 2


# --- builders -------------------------------------------------------------------------------------

def test_http_route_goes_to_the_pool_or_the_service():
    s = spec(gateway=GW)
    r = bg.http_route(s, OWNER, to_pool=True)
    assert r["apiVersion"] == "gateway.networking.k8s.io/v1" and r["metadata"]["name"] == "smollm2"
    assert r["metadata"]["ownerReferences"] == [b.owner_reference(OWNER)]
    assert r["spec"]["parentRefs"] == [{"name": "inference-gw", "namespace": "gateways", "sectionName": "http"}]
    assert r["spec"]["hostnames"] == ["llm.example.com"]
    rule = r["spec"]["rules"][0]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "smollm2"}]
    to_svc = bg.http_route(s, OWNER, to_pool=False)["spec"]["rules"][0]["backendRefs"]
    assert to_svc == [{"kind": "Service", "name": b.service(s, OWNER)["metadata"]["name"], "port": c.HTTP_PORT}]


def test_inference_pool_selects_the_serving_pods_and_names_its_picker():
    s = spec(gateway=GW)
    p = bg.inference_pool(s, OWNER)
    assert p["apiVersion"] == "inference.networking.k8s.io/v1"
    assert p["spec"]["selector"]["matchLabels"] == b.deployment(s, s.engine_hash, OWNER, replicas=1)[
        "spec"]["selector"]["matchLabels"]
    assert p["spec"]["targetPorts"] == [{"number": c.HTTP_PORT}]
    assert p["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "smollm2-epp", "port": {"number": 9002},
                                              "failureMode": "FailClose"}
    own = spec(gateway={"inferencePool": {"enabled": True, "endpointPicker": {"deploy": False, "serviceName": "epp"}}})
    assert bg.inference_pool(own, OWNER)["spec"]["endpointPickerRef"]["name"] == "epp"
    assert bg.endpoint_picker(own, OWNER, "pool-uid") == []


def test_endpoint_picker_reads_kiln_metrics_with_the_chart_role():
    objs = bg.endpoint_picker(spec(gateway=GW), OWNER, "pool-uid")
    assert [o["kind"] for o in objs] == ["ServiceAccount", "RoleBinding", "Deployment", "Service"]
    binding, dep, svc = objs[1], objs[2], objs[3]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "kiln-endpoint-picker"}
    # owned by the pool: deleting the InferencePool garbage-collects its picker
    assert all(o["metadata"]["ownerReferences"] == [{
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "name": "smollm2", "uid": "pool-uid",
        "controller": True, "blockOwnerDeletion": True}] for o in objs)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and "=" not in a}
    assert flags["--total-queued-requests-metric"] == "kiln_num_requests_waiting"
    assert flags["--kv-cache-usage-percentage-metric"] == "kiln_kv_cache_usage_ratio"
    assert flags["--pool-name"] == "smollm2" and flags["--pool-namespace"] == "team-a"
    assert flags["--model-server-metrics-port"] == str(c.HTTP_PORT)
    # the picker's pods are not the engine's: the Service and the pool never select them
    assert dep["spec"]["selector"]["matchLabels"][c.LABEL_COMPONENT] != c.COMPONENT_SERVER
    assert svc["spec"]["ports"][0]["port"] == 9002


@pytest.mark.parametrize("metric", [m.name for m in SCALING_METRICS if not m.per_engine])
def test_hpa_scales_on_the_selected_signal(metric):
    m = next(x for x in SCALING_METRICS if x.name == metric)
    h = ba.hpa(spec(autoscaling={"mode": "hpa", "metric": metric, "minReplicas": 1, "maxReplicas": 5}), OWNER)
    pods = h["spec"]["metrics"][0]["pods"]
    assert pods["metric"]["name"] == m.series
    assert pods["target"] == {"type": "AverageValue", "averageValue": b.to_quantity(m.default_target)}


def test_hpa_scales_on_the_routers_queue_as_an_external_metric():
    """routerQueue is the engine's total in the router: an External metric selected by the
    engine's name, averaged over the replicas by the HPA (ceil(total / target))."""
    h = ba.hpa(spec(autoscaling={"mode": "hpa", "metric": "routerQueue", "target": 6, "maxReplicas": 5}), OWNER)
    assert h["spec"]["metrics"] == [{"type": "External", "external": {
        "metric": {"name": "kiln_router_queue_requests", "selector": {"matchLabels": {"engine": "smollm2"}}},
        "target": {"type": "AverageValue", "averageValue": "6"}}}]
    assert spec(autoscaling={"mode": "hpa", "metric": "routerQueue"}).autoscaling.target_value == 4


def test_scaled_object_on_the_routers_queue_sums_the_engines_series():
    s = spec(autoscaling={"mode": "keda", "metric": "routerQueue", "target": 3, "keda": {"serverAddress": "http://prom:9090"}},
             model={"builtin": "smollm2-135m-instruct", "servedModelName": "chat"})
    t = ba.scaled_object(s, OWNER)["spec"]["triggers"][0]
    assert t["name"] == "routerqueue" and t["metricType"] == "AverageValue" and t["metadata"]["threshold"] == "3"
    assert t["metadata"]["query"] == 'sum(kiln_router_queue_requests{namespace="team-a",engine="smollm2"})'


def test_the_router_serves_the_series_of_its_scaling_signal():
    from prometheus_client import generate_latest

    from kiln.operator.router.metrics import RouterMetrics
    from kiln.operator.scaling_metrics import scaling_metric
    m = RouterMetrics()
    m.queue.labels("team-a", "smollm2", "chat").set(2)
    text = generate_latest(m.registry).decode()
    assert f'{scaling_metric("routerQueue").series}{{engine="smollm2",model="chat",namespace="team-a"}} 2.0' in text


def test_scaled_object_queries_prometheus_for_the_engine_pods():
    s = spec(autoscaling={"mode": "keda", "metric": "timeToFirstToken", "target": 2, "minReplicas": 1, "maxReplicas": 3,
                          "scaleDownStabilizationSeconds": 60, "keda": {"serverAddress": "http://prom:9090"}},
             model={"builtin": "smollm2-135m-instruct", "servedModelName": "chat"})
    so = ba.scaled_object(s, OWNER)
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert so["spec"]["scaleTargetRef"]["name"] == "smollm2"
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 3)
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 60}
    t = so["spec"]["triggers"][0]
    assert t["type"] == "prometheus" and t["metricType"] == "Value"
    assert t["metadata"]["threshold"] == "2" and t["metadata"]["serverAddress"] == "http://prom:9090"
    q = t["metadata"]["query"]
    assert 'kiln_time_to_first_token_seconds_sum{namespace="team-a",model_name="chat"}[2m]' in q
    assert 'kiln_time_to_first_token_seconds_count{namespace="team-a",model_name="chat"}[2m]' in q


# --- plan -----------------------------------------------------------------------------------------

def test_plan_applies_route_pool_and_picker_when_served():
    p = served_plan(spec(gateway=GW))
    ks = [(o["kind"], o["metadata"]["name"]) for o in p.apply]
    assert ks.index(("Deployment", "smollm2")) < ks.index(("InferencePool", "smollm2"))
    assert {("HTTPRoute", "smollm2"), ("InferencePool", "smollm2"), ("Deployment", "smollm2-epp"),
            ("Service", "smollm2-epp")} <= set(ks)
    assert p.manifest("Deployment")["metadata"]["name"] == "smollm2"  # the serving one first
    assert conds(p)["Exposed"] == ("True", "Applied")
    assert p.status["gateway"]["httpRoute"] == {"name": "smollm2", "backend": "InferencePool"}
    assert next(o for o in p.apply if o["kind"] == "RoleBinding")["roleRef"]["kind"] == "Role"  # the operator's flag
    first = served_plan(spec(gateway=GW), pool_uid=None)  # the pool is created first, its picker once it has a uid
    assert "InferencePool" in {o["kind"] for o in first.apply} and "RoleBinding" not in {o["kind"] for o in first.apply}


def test_missing_gateway_crds_give_a_reason_and_the_rest_reconciles():
    p = served_plan(spec(gateway=GW), served=frozenset())
    assert {o["kind"] for o in p.apply} >= {"Deployment", "Service"}
    assert not {"HTTPRoute", "InferencePool"} & {o["kind"] for o in p.apply}
    assert conds(p)["Exposed"] == ("False", "GatewayAPINotInstalled")
    assert conds(p)["Degraded"][0] == "False" and "gateway" not in p.status
    only_route = served_plan(spec(gateway=GW), served=frozenset({ROUTE}))
    assert conds(only_route)["Exposed"] == ("False", "InferencePoolNotInstalled")
    route = only_route.manifest("HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "Service"  # served through the Service meanwhile


def test_dropping_spec_gateway_deletes_what_was_applied():
    applied = served_plan(spec(gateway=GW)).status
    p = served_plan(spec(), status=applied)
    gone = {(r.kind, r.name) for r in p.delete}
    assert {("HTTPRoute", "smollm2"), ("InferencePool", "smollm2")} <= gone
    assert not [r for r in p.delete if r.name == "smollm2-epp"]  # garbage-collected with the pool
    assert ChildRef("apps/v1", "Deployment", "team-a", "smollm2") not in p.delete
    assert "Exposed" not in conds(p) and "gateway" not in p.status


def test_keda_mode_owns_replicas_only_when_keda_is_served():
    s = spec(autoscaling={"mode": "keda", "minReplicas": 2, "keda": {"serverAddress": "http://prom:9090"}})
    p = served_plan(s, served=frozenset({SCALED}))
    assert "replicas" not in p.manifest("Deployment")["spec"] and p.manifest("ScaledObject") == ba.scaled_object(s, OWNER)
    assert conds(p)["ScalerReady"] == ("True", "ScaledObjectApplied") and p.status["scaledObject"] == "smollm2"
    missing = served_plan(s, served=frozenset())
    assert missing.manifest("Deployment")["spec"]["replicas"] == 2 and missing.manifest("ScaledObject") is None
    assert conds(missing)["ScalerReady"] == ("False", "KEDANotInstalled")
    off = served_plan(spec(), served=frozenset({SCALED}), status=p.status)
    assert ChildRef("keda.sh/v1alpha1", "ScaledObject", "team-a", "smollm2") in off.delete


# --- builtin autoscaler on a gauge ----------------------------------------------------------------

def test_builtin_autoscaler_scales_on_a_gauge_signal():
    text = {"a": 'kiln_kv_cache_usage_ratio{model_name="m"} 0.95\n', "b": 'kiln_kv_cache_usage_ratio{model_name="m"} 0.65\n'}
    scaler = BuiltinAutoscaler(fetcher=lambda pod: text[pod["metadata"]["name"]], clock=lambda: 100.0)
    s = spec(autoscaling={"mode": "builtin", "metric": "kvCacheUsage", "target": 0.5, "maxReplicas": 8})
    pods = [{"metadata": {"name": n}} for n in ("a", "b")]
    assert scaler.observe("ns/e", pods, 2, s.autoscaling, NOW)
    want, st, _ = scaler.wish("ns/e")
    assert want == 4 and st["metric"] == "kvCacheUsage" and st["observedValue"] == 0.8  # ceil(2 * 0.8 / 0.5)


def test_builtin_autoscaler_scales_on_the_routers_queue():
    """The router pods' real exposition (RouterMetrics): the engine's series summed over router
    pods and models, other engines and namespaces ignored, divided by the current replicas."""
    from prometheus_client import generate_latest

    from kiln.operator.router.metrics import RouterMetrics
    routers = {n: RouterMetrics() for n in ("router-a", "router-b")}
    routers["router-a"].queue.labels("team-a", "smollm2", "smollm2").set(7)
    routers["router-a"].queue.labels("team-a", "smollm2", "tuned").set(2)  # an adapter of the engine
    routers["router-b"].queue.labels("team-a", "smollm2", "smollm2").set(3)
    routers["router-b"].queue.labels("team-b", "smollm2", "smollm2").set(50)  # another namespace's engine
    routers["router-b"].queue.labels("team-a", "other", "other").set(40)
    now = [100.0]
    scaler = BuiltinAutoscaler(fetcher=lambda pod: generate_latest(routers[pod["metadata"]["name"]].registry).decode(),
                               clock=lambda: now[0])
    s = spec(autoscaling={"mode": "builtin", "metric": "routerQueue", "maxReplicas": 8})
    pods = [{"metadata": {"name": n}} for n in routers]
    assert scaler.observe("team-a/smollm2", pods, 1, s.autoscaling, NOW)
    want, st, active = scaler.wish("team-a/smollm2")
    assert want == 3 and st["metric"] == "routerQueue" and st["observedValue"] == 12  # ceil(12 / 4)
    assert active == NOW  # a queue is activity (the scale-to-zero idle window)
    for r in routers.values():
        for lab in (("team-a", "smollm2", "smollm2"), ("team-a", "smollm2", "tuned")):
            r.queue.labels(*lab).set(0)
    s2 = spec(autoscaling={"mode": "builtin", "metric": "routerQueue", "maxReplicas": 8,
                           "scaleDownStabilizationSeconds": 0})
    now[0] += 10
    assert scaler.observe("team-a/smollm2", pods, 3, s2.autoscaling, NOW)
    assert scaler.wish("team-a/smollm2")[0] == 1


def test_the_http_fetcher_reads_the_pods_http_port():
    from kiln.operator.autoscaler import _http_port
    router_pod = {"spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]}}
    assert _http_port(router_pod) == 8080 and _http_port({"spec": {"containers": [{}]}}) == c.HTTP_PORT


# --- the pieces outside Kiln: the EPP's real flags, the chart's adapter rules -----------------------

def test_endpoint_picker_flags_exist_in_the_epp_it_runs():
    """Every flag passed to the EPP is defined by its command line (cmd/epp/runner/runner.go of
    the gateway-api-inference-extension module version whose image is the default)."""
    from kiln.devcluster.crds import CRD_SETS, module_dir, versions
    from kiln.operator.gateway_spec import EPP_IMAGE
    crd_set = CRD_SETS["inference-extension"]
    version = versions()[crd_set.version_key]
    assert EPP_IMAGE.endswith(f":{version}")
    try:
        src = (module_dir(crd_set.module, version) / "cmd/epp/runner/runner.go").read_text()
    except FileNotFoundError as e:
        skip_or_fail_in_ci(f"the EPP's module could not be fetched: {e}")
    defined = set(re.findall(r'flag\.(?:String|Int|Bool|Duration|Float64)\("([a-z0-9-]+)"', src))
    bools = set(re.findall(r'flag\.Bool\("([a-z0-9-]+)"', src))
    args = bg.epp_args(spec(gateway=GW), OWNER)
    passed = [a[2:].split("=", 1)[0] for a in args if a.startswith("--")]
    assert passed and set(passed) <= defined, set(passed) - defined
    for a in args:  # a Go bool flag takes its value only as --flag=value
        if a.startswith("--") and a[2:].split("=", 1)[0] in bools:
            assert "=" in a, a


def test_a_missing_outside_piece_skips_here_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail_in_ci("no network")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no network"):
        skip_or_fail_in_ci("no network")


def test_chart_adapter_rules_serve_every_hpa_signal():
    """Each signal's series is served by a rule of the chart's prometheus-adapter ConfigMap, under
    the name the HPA asks for (histograms renamed from their _sum series)."""
    text = (ROOT / "helm/kiln/templates/prometheus-adapter-rule.yaml").read_text()
    custom, _, external = text.partition("\n      external:\n")
    series = set(re.findall(r"seriesQuery: '([a-z_]+)\{", custom))
    renamed = set(re.findall(r'as: "([a-z_]+)"', custom))
    for m in SCALING_METRICS:
        if m.per_engine:  # the HPA's External metric: the chart's rules.external
            assert f"seriesQuery: '{m.series}{{" in external, m.name
            assert m.series not in series, m.name
        elif m.kind == "histogram":
            assert f"{m.series}_sum" in series and m.series in renamed, m.name
        else:
            assert m.series in series, m.name
