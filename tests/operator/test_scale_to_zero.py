"""Scale to zero on plain data: the spec's rules (minReplicas 0 needs builtin mode and an idle
window), the idle decision (kiln.operator.idle) and the planner: idle -> 0 replicas, Ready with
Available=ScaledToZero; the router's last-request annotation (or the autoscaler seeing requests)
-> at least 1; a requeue when the window ends."""

from __future__ import annotations

import pytest

from kiln.operator import builders as b
from kiln.operator import constants as c
from kiln.operator.idle import idle_state, parse_time
from kiln.operator.plan import Observed, ScalerWish, plan
from kiln.operator.spec import EngineSpecError, parse_spec

OWNER = {"name": "smollm2", "namespace": "team-a", "uid": "u-1"}
ZERO = {"mode": "builtin", "minReplicas": 0, "maxReplicas": 3, "scaleToZeroAfterSeconds": 60}
RAW = {"model": {"builtin": "smollm2-135m-instruct"}, "autoscaling": ZERO}
SPEC = parse_spec(RAW)
H = SPEC.engine_hash
CREATED = "2026-01-02T00:00:00Z"


def record():
    return {"metadata": {"name": b.record_name("kiln-engine-cache", H)}, "data": {"engineHash": H}}


def deployment(replicas, ready):
    d = b.deployment(SPEC, H, OWNER, replicas=replicas)
    d["metadata"]["generation"] = 1
    d["status"] = {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas, "readyReplicas": ready}
    return d


def observed(dep, **kw):
    return Observed(owner=OWNER, generation=1, claim_exists=True, record=record(), deployment=dep,
                    created=CREATED, **kw)


def conds(p):
    return {x["type"]: (x["status"], x["reason"]) for x in p.status["conditions"]}


@pytest.mark.parametrize("scaling, needle", [
    ({"mode": "builtin", "minReplicas": 0}, "scaleToZeroAfterSeconds"),
    ({"mode": "hpa", "minReplicas": 0, "scaleToZeroAfterSeconds": 60}, "mode builtin"),
    ({"mode": "off", "minReplicas": 0, "scaleToZeroAfterSeconds": 60}, "mode builtin"),
    ({"mode": "builtin", "minReplicas": 0, "scaleToZeroAfterSeconds": 0}, "at least 1"),
])
def test_min_replicas_zero_needs_builtin_and_a_window(scaling, needle):
    with pytest.raises(EngineSpecError, match=needle):
        parse_spec({**RAW, "autoscaling": scaling})


def test_spec_parses_the_window():
    a = SPEC.autoscaling
    assert a.scales_to_zero and a.min_replicas == 0 and a.scale_to_zero_after_seconds == 60 and a.max_replicas == 3
    with pytest.raises(EngineSpecError, match="scaleToZeroAfterSeconds: only with minReplicas: 0"):
        parse_spec({**RAW, "autoscaling": {"mode": "builtin", "scaleToZeroAfterSeconds": 60}})  # not accepted and ignored


def test_idle_state():
    a = SPEC.autoscaling
    assert idle_state(a, [None, "not a time"], "2026-01-02T00:10:00Z").active  # nothing known: new, active
    s = idle_state(a, ["2026-01-02T00:09:30Z", None, CREATED], "2026-01-02T00:10:00Z")
    assert s.active and s.seconds_left == 30 and s.last_used == "2026-01-02T00:09:30Z"
    s = idle_state(a, ["2026-01-02T00:09:00+00:00"], "2026-01-02T00:10:00Z")
    assert not s.active and s.seconds_left is None
    assert parse_time("2026-01-02T00:09:00") == parse_time("2026-01-02T00:09:00Z")


def test_a_start_is_never_cut_short():
    late = "2026-01-02T01:00:00Z"  # long past the window since creation
    first = plan(SPEC, observed(None), late)  # the engine just built: no Deployment yet
    assert first.manifest("Deployment")["spec"]["replicas"] == 1
    starting = plan(SPEC, observed(deployment(1, 0)), late)  # its pod is not ready yet
    assert starting.manifest("Deployment")["spec"]["replicas"] == 1 and starting.requeue_after is None


def test_a_new_engine_serves_until_idle_then_goes_to_zero():
    busy = plan(SPEC, observed(deployment(1, 1)), "2026-01-02T00:00:50Z")
    assert busy.manifest("Deployment")["spec"]["replicas"] == 1 and busy.requeue_after == pytest.approx(10)
    assert busy.phase == c.PHASE_READY and busy.status["autoscaler"]["lastActivityTime"] == CREATED
    idle = plan(SPEC, observed(deployment(1, 1)), "2026-01-02T00:01:00Z")
    assert idle.manifest("Deployment")["spec"]["replicas"] == 0 and idle.replicas == 0
    at_zero = plan(SPEC, observed(deployment(0, 0)), "2026-01-02T00:05:00Z")
    assert at_zero.manifest("Deployment")["spec"]["replicas"] == 0
    assert at_zero.phase == c.PHASE_READY and conds(at_zero)["Available"] == ("True", "ScaledToZero")
    assert conds(at_zero)["Degraded"] == ("False", "AsExpected") and at_zero.requeue_after is None


def test_a_pod_that_just_turned_ready_gets_a_whole_window():
    pod = {"metadata": {"name": "p"}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-02T00:04:50Z"}]}}
    gone = {"metadata": {"name": "q", "deletionTimestamp": "x"}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-02T00:05:30Z"}]}}
    p = plan(SPEC, observed(deployment(1, 1), serving_pods=(pod, gone)), "2026-01-02T00:05:00Z")
    assert p.manifest("Deployment")["spec"]["replicas"] == 1 and p.requeue_after == pytest.approx(50)
    p = plan(SPEC, observed(deployment(1, 1), serving_pods=(pod,)), "2026-01-02T00:05:50Z")
    assert p.manifest("Deployment")["spec"]["replicas"] == 0


def test_a_request_through_the_router_wakes_it():
    woken = plan(SPEC, observed(deployment(0, 0), last_request="2026-01-02T00:04:59Z"), "2026-01-02T00:05:00Z")
    assert woken.manifest("Deployment")["spec"]["replicas"] == 1
    assert woken.phase == c.PHASE_DEPLOYING and conds(woken)["Available"] == ("False", "NoReadyReplicas")
    assert woken.status["autoscaler"]["lastActivityTime"] == "2026-01-02T00:04:59Z"


def test_direct_traffic_seen_by_the_autoscaler_keeps_it_up_and_its_wish_counts():
    wish = ScalerWish(3, {"desiredReplicas": 3}, "2026-01-02T00:04:30Z")
    p = plan(SPEC, observed(deployment(1, 1), wish=wish), "2026-01-02T00:05:00Z")
    assert p.manifest("Deployment")["spec"]["replicas"] == 3
    low = ScalerWish(0, {"desiredReplicas": 0}, "2026-01-02T00:04:30Z")  # quiet queue, but used: never below 1
    assert plan(SPEC, observed(deployment(2, 2), wish=low), "2026-01-02T00:05:00Z").manifest(
        "Deployment")["spec"]["replicas"] == 1


def test_suspend_beats_scale_to_zero_and_min_one_is_unchanged():
    s = parse_spec({**RAW, "suspend": True})
    p = plan(s, observed(deployment(1, 1), last_request="2026-01-02T00:04:59Z"), "2026-01-02T00:05:00Z")
    assert p.manifest("Deployment")["spec"]["replicas"] == 0 and p.phase == c.PHASE_SUSPENDED
    one = parse_spec({**RAW, "autoscaling": {"mode": "builtin", "minReplicas": 1}})
    p = plan(one, observed(deployment(1, 1)), "2026-01-09T00:00:00Z")  # long idle: min 1 stays
    assert p.manifest("Deployment")["spec"]["replicas"] == 1 and "lastActivityTime" not in p.status.get("autoscaler", {})


def test_the_crd_admits_zero_only_with_builtin_and_a_window():
    from crdcheck import admit

    def ie(scaling):
        return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"},
                "spec": {"model": {"builtin": "smollm2-135m-instruct"}, "autoscaling": scaling}}

    obj, errors = admit(ie(ZERO))
    assert errors == [] and parse_spec(obj["spec"]).autoscaling.scales_to_zero
    for bad in ({"mode": "builtin", "minReplicas": 0}, {"minReplicas": 0, "scaleToZeroAfterSeconds": 60},
                {"mode": "hpa", "minReplicas": 0, "scaleToZeroAfterSeconds": 60}):
        _, errors = admit(ie(bad))
        assert any("minReplicas: 0 needs mode builtin" in e for e in errors), (bad, errors)
    _, errors = admit(ie({**ZERO, "scaleToZeroAfterSeconds": 0}))
    assert errors and "scaleToZeroAfterSeconds" in errors[0]
    _, errors = admit(ie({"mode": "builtin", "minReplicas": -1}))
    assert errors and "minReplicas" in errors[0]


def test_the_controllers_cached_body_keeps_what_the_idle_decision_reads():
    from kiln.operator.controller import _plain

    body = {"apiVersion": c.API_VERSION, "kind": c.KIND, "spec": RAW,
            "metadata": {"name": "z", "namespace": "ns", "uid": "u", "creationTimestamp": CREATED,
                         "annotations": {c.ANNOTATION_LAST_REQUEST: "2026-01-02T00:04:59Z", "other": "x"}}}
    meta = _plain(body)["metadata"]
    assert meta["creationTimestamp"] == CREATED
    assert meta["annotations"] == {c.ANNOTATION_LAST_REQUEST: "2026-01-02T00:04:59Z"}
    assert "annotations" not in _plain({**body, "metadata": {"name": "z", "namespace": "ns"}})["metadata"]
