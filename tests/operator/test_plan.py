"""The pure planner on plain data: one test per phase transition of an InferenceEngine.

No API, no fake one: an ``Observed`` (what a reconcile read) goes in, a ``Plan`` (children to
apply, children to delete, the status) comes out.
"""

import copy
import json

import pytest

from kiln.operator import builders as b
from kiln.operator import builders_autoscaling as ba
from kiln.operator import constants as c
from kiln.operator.plan import ChildRef, Observed, ScalerWish, plan
from kiln.operator.spec import InvalidSpec, parse_spec

NOW = "2026-01-02T03:04:05Z"
OWNER = {"name": "smollm2", "namespace": "team-a", "uid": "u-1"}
RAW = {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "int4-awq"}, "replicas": 2}
SPEC = parse_spec(RAW)
H = SPEC.engine_hash
CLAIM = "kiln-engine-cache"


def spec(**changes):
    return parse_spec({**RAW, **changes})


def job(hash_, state="running", **status):
    st = {"running": {"active": 1, "startTime": "2026-01-01T00:00:00Z"},
          "pending": {},
          "succeeded": {"succeeded": 1, "completionTime": "2026-01-01T01:00:00Z",
                        "conditions": [{"type": "Complete", "status": "True"}]},
          "failed": {"failed": 2, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                  "message": "Job has reached the specified backoff limit"}]}}[state]
    return {"metadata": {"name": b.job_name("kiln-engine-cache", hash_),
                         "labels": b.build_labels("kiln-engine-cache", hash_)}, "status": {**st, **status}}


def record(hash_, built_by="team-a/smollm2-build-x"):
    return {"metadata": {"name": b.record_name("kiln-engine-cache", hash_)},
            "data": {"engineHash": hash_, "builtBy": built_by}}


def deployment(hash_, replicas=2, ready=0, updated=None, generation=1, observed_generation=1):
    d = b.deployment(SPEC, hash_, OWNER, replicas=replicas)
    d["metadata"]["generation"] = generation
    d["status"] = {"observedGeneration": observed_generation, "replicas": replicas,
                   "updatedReplicas": replicas if updated is None else updated, "readyReplicas": ready}
    return d


def observed(**fields):
    return Observed(**{"owner": OWNER, "generation": 3, "claim_exists": True, **fields})


def kinds(p):
    return [o["kind"] for o in p.apply]


def cond(p, type_):
    return next(x for x in p.status["conditions"] if x["type"] == type_)


def reasons(p):
    return {x["type"]: (x["status"], x["reason"]) for x in p.status["conditions"]}


def test_new_resource_is_pending_to_building():
    """Nothing exists: the claim, the build Job and the Service are applied; no Deployment."""
    p = plan(SPEC, observed(claim_exists=False), NOW)
    assert kinds(p) == ["PersistentVolumeClaim", "Job", "Service"] and p.delete == ()
    assert p.manifest("Job") == b.build_job(SPEC, H, OWNER)
    assert p.phase == p.status["phase"] == c.PHASE_BUILDING and p.hash == H and not p.built
    assert reasons(p) == {"EngineBuilt": ("False", "Building"), "Available": ("False", "EngineNotBuilt"),
                          "Progressing": ("True", "Building"), "Degraded": ("False", "AsExpected")}
    st = p.status
    assert st["engineHash"] == H and st["model"] == "builtin:smollm2-135m-instruct"
    assert st["endpoint"] == "http://smollm2.team-a.svc:8000/v1" and st["selector"] == b.selector_string(OWNER)
    assert st["build"] == {"jobName": b.job_name("kiln-engine-cache", H), "state": "Pending",
                           "message": f"building engine {H} with int4-awq"}
    assert (st["replicas"], st["readyReplicas"]) == (0, 0) and "servingEngineHash" not in st
    assert all(x["observedGeneration"] == 3 and x["lastTransitionTime"] == NOW for x in st["conditions"])
    assert p.serving_hash is None and p.replicas is None


def test_running_build_creates_nothing_new():
    p = plan(SPEC, observed(jobs=(job(H),)), NOW)
    assert kinds(p) == ["Service"]
    assert p.status["build"]["state"] == "Running" and p.status["build"]["startTime"] == "2026-01-01T00:00:00Z"
    assert cond(p, "EngineBuilt")["message"] == f"build Job {b.job_name(CLAIM, H)} is running"


def test_running_build_shows_the_progress_of_its_log():
    """The build pod's last progress line goes into status.build (and its printer column)."""
    from kiln.common.progress import BuildProgress

    prog = BuildProgress("quantize", 75, 12, 30, "calibrate+quantize: layer 12/30")
    p = plan(SPEC, observed(jobs=(job(H),), build_progress=prog), NOW)
    st = p.status["build"]
    assert (st["stage"], st["layer"], st["numLayers"], st["elapsedSeconds"]) == ("quantize", 12, 30, 75)
    assert st["progress"] == "quantize 12/30, 1m15s"
    assert st["message"].endswith(": calibrate+quantize: layer 12/30")
    # a finished build reports no stale stage
    done = plan(SPEC, observed(jobs=(job(H, "succeeded"),), build_progress=prog), NOW)
    assert "stage" not in done.status["build"] and done.status["build"]["state"] == "Succeeded"


def test_succeeded_build_is_recorded_and_deployed():
    """Building -> Deploying: the Job succeeded, so the engine record is written and the
    Deployment of the new engine is created in the same plan."""
    p = plan(SPEC, observed(jobs=(job(H, "succeeded"),)), NOW)
    assert kinds(p) == ["ConfigMap", "Deployment", "Service"]
    assert p.manifest("ConfigMap") == b.engine_record(SPEC, H, OWNER, b.job_name("kiln-engine-cache", H), "2026-01-01T01:00:00Z")
    assert p.manifest("Deployment") == b.deployment(SPEC, H, OWNER, replicas=2)
    assert p.delete == (ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", "team-a", "smollm2"),)
    assert p.built and p.serving_hash == H and p.replicas == 2 and p.phase == c.PHASE_DEPLOYING
    assert reasons(p) == {"EngineBuilt": ("True", "BuildSucceeded"), "Available": ("False", "NoReadyReplicas"),
                          "Progressing": ("True", "RollingOut"), "Degraded": ("False", "AsExpected")}
    assert p.status["build"]["state"] == "Succeeded" and p.status["servingEngineHash"] == H


def test_record_of_a_job_without_completion_time_is_stamped_now():
    done = job(H, "succeeded")
    del done["status"]["completionTime"]
    p = plan(SPEC, observed(jobs=(done,)), NOW)
    assert p.manifest("ConfigMap")["data"]["completedAt"] == NOW


def test_deploying_until_rolled_out_then_ready():
    """Deploying -> Ready: ready only when every replica is updated, ready and observed."""
    seen = dict(record=record(H), jobs=(job(H, "succeeded"),))
    rolling = plan(SPEC, observed(deployment=deployment(H, ready=1, updated=1), **seen), NOW)
    assert rolling.phase == c.PHASE_DEPLOYING
    assert reasons(rolling)["Available"] == ("True", "MinimumReplicasAvailable")
    assert cond(rolling, "Progressing")["message"] == "1/2 replicas updated"
    ready = plan(SPEC, observed(deployment=deployment(H, ready=2), **seen), NOW)
    assert ready.phase == c.PHASE_READY and ready.status["readyReplicas"] == 2 and ready.status["replicas"] == 2
    assert reasons(ready) == {"EngineBuilt": ("True", "BuildSucceeded"),
                              "Available": ("True", "MinimumReplicasAvailable"),
                              "Progressing": ("False", "ReconcileComplete"), "Degraded": ("False", "AsExpected")}
    assert ready.manifest("Deployment") == b.deployment(SPEC, H, OWNER, replicas=2)  # re-applied: drift repair
    stale = plan(SPEC, observed(deployment=deployment(H, ready=2, generation=2, observed_generation=1), **seen), NOW)
    assert stale.phase == c.PHASE_DEPLOYING  # its controller has not seen the last change yet


def test_cached_engine_needs_no_build():
    """A record without a Job (a revert, or another resource's build): EngineCached."""
    p = plan(SPEC, observed(record=record(H, "team-a/other-build-1")), NOW)
    assert "Job" not in kinds(p) and "Deployment" in kinds(p)
    assert p.status["build"] == {"state": "Cached", "jobName": "team-a/other-build-1"}
    assert reasons(p)["EngineBuilt"] == ("True", "EngineCached")


def test_failed_build_degrades_without_a_deployment():
    p = plan(SPEC, observed(jobs=(job(H, "failed"),)), NOW)
    assert kinds(p) == ["Service"] and p.delete == ()  # no retry storm, no Deployment
    assert p.phase == c.PHASE_DEGRADED
    d = cond(p, "Degraded")
    assert d["status"] == "True" and d["reason"] == "BuildFailed" and "BackoffLimitExceeded" in d["message"]
    assert reasons(p)["EngineBuilt"] == ("False", "BuildFailed")
    assert reasons(p)["Progressing"] == ("False", "BuildFailed")
    assert p.status["build"]["state"] == "Failed" and p.status["build"]["failedAttempts"] == 2


def test_invalid_spec_is_degraded_and_touches_nothing():
    p = plan(InvalidSpec("model: exactly one source is required", model=""), observed(), NOW)
    assert p.apply == () and p.delete == () and p.hash is None and p.phase == c.PHASE_DEGRADED
    assert {x["type"]: (x["status"], x["reason"]) for x in p.status["conditions"]} == {
        "EngineBuilt": ("False", "InvalidSpec"), "Available": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"), "Degraded": ("True", "InvalidSpec")}
    assert cond(p, "Degraded")["message"] == "model: exactly one source is required"
    assert p.status["replicas"] == 0 and "engineHash" not in p.status


def test_suspend_stops_a_running_build():
    p = plan(spec(suspend=True), observed(jobs=(job(H),)), NOW)
    assert "Job" not in kinds(p)
    assert p.delete == (ChildRef("batch/v1", "Job", "team-a", b.job_name("kiln-engine-cache", H)),)
    assert p.phase == c.PHASE_SUSPENDED
    assert p.status["build"] == {"state": "Pending", "jobName": b.job_name("kiln-engine-cache", H), "message": "suspended"}
    assert reasons(p) == {"EngineBuilt": ("False", "Suspended"), "Available": ("False", "Suspended"),
                          "Progressing": ("False", "ReconcileComplete"), "Degraded": ("False", "AsExpected")}
    assert plan(spec(suspend=True), observed(), NOW).delete == ()  # nothing runs: nothing to stop


def test_suspend_scales_the_deployment_to_zero():
    s = spec(suspend=True)
    p = plan(s, observed(record=record(H), deployment=deployment(H, ready=2)), NOW)
    assert p.manifest("Deployment")["spec"]["replicas"] == 0 and p.replicas == 0
    assert p.phase == c.PHASE_SUSPENDED and ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", "team-a",
                                                     "smollm2") in p.delete
    # suspended mid-change: the Deployment keeps its engine, scaled to zero, while no build runs
    old = plan(s, observed(deployment=deployment("0" * 16, ready=2)), NOW)
    assert old.manifest("Deployment")["spec"]["template"]["metadata"]["labels"][c.LABEL_ENGINE_HASH] == "0" * 16
    assert old.manifest("Deployment")["spec"]["replicas"] == 0 and "Job" not in kinds(old)


def test_engine_hash_change_keeps_the_old_deployment_until_the_new_engine_is_built():
    old = "0" * 16
    p = plan(SPEC, observed(deployment=deployment(old, ready=2), jobs=(job(H),)), NOW)
    assert "Deployment" not in kinds(p)  # the old pods keep serving, untouched
    assert p.serving_hash == old and p.status["servingEngineHash"] == old and p.status["engineHash"] == H
    assert p.phase == c.PHASE_BUILDING and reasons(p)["Available"] == ("True", "MinimumReplicasAvailable")
    # the new engine is recorded: the Deployment rolls to it
    p = plan(SPEC, observed(deployment=deployment(old, ready=2), record=record(H), jobs=(job(H, "succeeded"),)), NOW)
    assert p.manifest("Deployment")["spec"]["template"]["metadata"]["labels"][c.LABEL_ENGINE_HASH] == H
    assert p.serving_hash == H and p.phase == c.PHASE_DEPLOYING
    assert reasons(p)["Progressing"] == ("True", "RollingOut")


def test_superseded_running_build_is_stopped_and_finished_ones_kept():
    old_running, old_done = job("1" * 16), job("2" * 16, "succeeded")
    gone = job("3" * 16)
    gone["metadata"]["deletionTimestamp"] = NOW
    p = plan(SPEC, observed(jobs=(old_running, old_done, gone)), NOW)
    assert p.delete == (ChildRef("batch/v1", "Job", "team-a", old_running["metadata"]["name"]),)
    assert "Job" in kinds(p)  # the wanted build starts


def test_missing_existing_claim_degrades_and_builds_nothing():
    p = plan(spec(storage={"claimName": "mine", "create": False}), observed(claim_exists=False), NOW)
    assert kinds(p) == ["Service"] and p.phase == c.PHASE_DEGRADED
    assert cond(p, "Degraded")["reason"] == "ClaimNotFound" and "mine" in cond(p, "Degraded")["message"]


@pytest.mark.parametrize("autoscaling, wish, current, want", [
    ({"mode": "off"}, ScalerWish(), None, 2),  # spec.replicas
    ({"mode": "hpa", "maxReplicas": 5}, ScalerWish(), 4, None),  # the HPA owns them: left out
    ({"mode": "builtin", "maxReplicas": 5}, ScalerWish(3, {"desiredReplicas": 3}), 1, 3),
    ({"mode": "builtin", "maxReplicas": 5}, ScalerWish(99, {"desiredReplicas": 99}), 1, 5),  # clamped
    ({"mode": "builtin", "minReplicas": 2, "maxReplicas": 5}, ScalerWish(), 4, 4),  # no wish yet: keep
    ({"mode": "builtin", "minReplicas": 2, "maxReplicas": 5}, ScalerWish(), None, 2),  # new: the minimum
])
def test_one_owner_of_replicas(autoscaling, wish, current, want):
    dep = None if current is None else deployment(H, replicas=current)
    s = spec(autoscaling=autoscaling)
    p = plan(s, observed(record=record(H), deployment=dep, wish=wish), NOW)
    manifest = p.manifest("Deployment")
    assert manifest["spec"].get("replicas") == want
    hpa_ref = ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", "team-a", "smollm2")
    if autoscaling["mode"] == "hpa":
        assert p.manifest("HorizontalPodAutoscaler") == ba.hpa(s, OWNER) and hpa_ref not in p.delete
        assert p.replicas == current  # the HPA's choice stays
    else:
        assert p.manifest("HorizontalPodAutoscaler") is None and hpa_ref in p.delete
    assert p.status.get("autoscaler") == (dict(wish.status) if wish.status else None)


def test_plan_is_pure():
    seen = observed(record=record(H), deployment=deployment(H, ready=2),
                    status={"conditions": [{"type": "Available", "status": "True", "reason": "X",
                                            "lastTransitionTime": "2025-12-31T00:00:00Z"}]})
    before = copy.deepcopy(seen)
    assert plan(SPEC, seen, NOW) == plan(SPEC, seen, NOW)
    assert seen == before  # inputs not mutated
    # a condition whose status did not change keeps its transition time
    assert cond(plan(SPEC, seen, NOW), "Available")["lastTransitionTime"] == "2025-12-31T00:00:00Z"
    assert cond(plan(SPEC, seen, NOW), "EngineBuilt")["lastTransitionTime"] == NOW


def test_default_image_is_the_operators_unless_the_spec_names_one():
    p = plan(SPEC, observed(), NOW, default_image="registry.local/kiln:dev")
    assert p.manifest("Job")["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/kiln:dev"
    p = plan(spec(image="mine:1"), observed(), NOW, default_image="registry.local/kiln:dev")
    assert p.manifest("Job")["spec"]["template"]["spec"]["containers"][0]["image"] == "mine:1"


def test_recorded_engine_shows_its_size_and_a_cleanup_holds_builds_back():
    from kiln.common.enginecache import format_build_report

    pod = {"metadata": {"name": "p"}, "status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 0, "finishedAt": "2026-01-01T01:00:00Z", "message": format_build_report(H, 123456)}}}]}}
    p = plan(SPEC, observed(jobs=(job(H, "succeeded"),), build_pods=(pod,)), NOW)
    assert p.manifest("ConfigMap")["data"]["sizeBytes"] == "123456"
    assert p.status["engine"] == {"hash": H, "sizeBytes": 123456}
    cached = plan(SPEC, observed(record=p.manifest("ConfigMap")), NOW)
    assert cached.status["engine"] == {"hash": H, "sizeBytes": 123456}
    held = plan(SPEC, observed(cleanup_active=True), NOW)
    assert "Job" not in kinds(held) and "cleanup" in held.status["build"]["message"]


def test_a_failed_accuracy_gate_is_degraded_with_its_numbers_and_the_old_engine_serves():
    old = "0" * 16
    gate = spec(build={"quantization": "int4-awq", "accuracyGate": {"maxPerplexityIncrease": 0.02}})
    h = gate.engine_hash
    msg = "kiln build: AccuracyGateFailed: the engine failed its accuracy gate: perplexity 5.100 -> 5.600 (+9.80%) is above the maximum increase of 2.00%"
    pod = {"metadata": {"name": "p"}, "status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 3, "finishedAt": "2026-01-01T01:00:00Z", "message": msg}}}]}}
    p = plan(gate, observed(jobs=(job(h, "failed"),), build_pods=(pod,), deployment=deployment(old, ready=2)), NOW)
    assert reasons(p)["Degraded"] == ("True", "AccuracyGateFailed") and "+9.80%" in cond(p, "Degraded")["message"]
    assert "Deployment" not in kinds(p) and p.serving_hash == old and "ConfigMap" not in kinds(p)
    job_args = b.build_job(gate, h, OWNER)["spec"]["template"]["spec"]["containers"][0]["args"]
    from kiln.runtime.build_cli import add_build_args
    import argparse
    a = add_build_args(argparse.ArgumentParser()).parse_args(job_args)  # the flags exist in kiln build
    assert (a.max_perplexity_increase, a.min_greedy_agreement, a.gate_prompts) == (0.02, None, 8)
    # a passing one: its numbers in the record and status.engine
    from kiln.common.enginecache import format_build_report
    acc = {"perplexityIncrease": 0.01, "greedyAgreement": 0.97}
    ok = {"metadata": {"name": "p"}, "status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 0, "message": format_build_report(h, 10, acc)}}}]}}
    p = plan(gate, observed(jobs=(job(h, "succeeded"),), build_pods=(ok,)), NOW)
    assert p.status["engine"]["accuracy"] == acc


# -- runtime.tensorParallelSize against the built engine (the build's report: its shape) ----
HUB_TP = {"model": {"huggingFace": {"repo": "org/llama"}}, "replicas": 2}


def built_with(spec_, shape):
    """A succeeded build of ``spec_``'s engine whose pod reported ``shape`` (a dict)."""
    from kiln.common.enginecache import format_build_report

    h = spec_.engine_hash
    pod = {"metadata": {"name": "p"}, "status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 0, "finishedAt": "2026-01-01T01:00:00Z", "message": format_build_report(h, 10, shape=shape)}}}]}}
    return observed(jobs=(job(h, "succeeded"),), build_pods=(pod,))


SHAPE = {"numAttentionHeads": 6, "numKeyValueHeads": 2, "headDim": 64, "intermediateSize": 1024}


def test_a_tensor_parallel_size_the_built_engine_does_not_split_is_degraded_before_any_pod():
    """A Hub model (heads unknown until built) at runtime.tensorParallelSize 4: the build's
    report says 6 heads, 2 KV heads; the record keeps that shape, no Deployment is applied,
    Degraded says why with the numbers; the Service is applied as usual.  The old
    Deployment (another engine) keeps serving untouched."""
    s = parse_spec({**HUB_TP, "runtime": {"tensorParallelSize": 4}})
    p = plan(s, built_with(s, SHAPE), NOW)
    assert kinds(p) == ["ConfigMap", "Service"] and p.built and p.serving_hash is None
    assert json.loads(p.manifest("ConfigMap")["data"]["shape"]) == SHAPE
    assert p.phase == c.PHASE_DEGRADED and p.requeue_after is None
    assert reasons(p) == {"EngineBuilt": ("True", "BuildSucceeded"), "Available": ("False", "EngineNotBuilt"),
                          "Progressing": ("False", "TensorParallelSizeInvalid"),
                          "Degraded": ("True", "TensorParallelSizeInvalid")}
    msg = cond(p, "Degraded")["message"]
    assert f"engine {s.engine_hash}: runtime.tensorParallelSize 4 does not split the model's 6 attention heads " \
           "and 2 KV heads" in msg, msg
    # the same from the cached record, with an older engine's Deployment serving
    old = "0" * 16
    p = plan(s, observed(record=p.manifest("ConfigMap"), deployment=deployment(old, ready=2)), NOW)
    assert "Deployment" not in kinds(p) and p.serving_hash == old and p.replicas == 2
    assert reasons(p)["Degraded"] == ("True", "TensorParallelSizeInvalid") and p.status["readyReplicas"] == 2
    # 2 splits 6 heads and 2 KV heads: the Deployment rolls out
    s2 = parse_spec({**HUB_TP, "runtime": {"tensorParallelSize": 2}})
    p = plan(s2, built_with(s2, SHAPE), NOW)
    assert kinds(p) == ["ConfigMap", "Deployment", "Service"] and reasons(p)["Degraded"] == ("False", "AsExpected")


@pytest.mark.parametrize("tp, shape, words", [
    (4, {**SHAPE, "numAttentionHeads": 8, "numKeyValueHeads": 8, "intermediateSize": 1030},
     "does not split the model's MLP intermediate size 1030"),
    # 8 x 64 = 512 o_proj inputs: 128 per rank at 4, 64 at 8 (not a multiple of the group size 128)
    (8, {**SHAPE, "numAttentionHeads": 8, "numKeyValueHeads": 8, "int4GroupSize": 128},
     "does not split the int4 engine's o_proj (512 input features): each rank's 64 must be a multiple of the "
     "group size 128"),
])
def test_tensor_parallel_size_checks_the_mlp_and_int4_groups(tp, shape, words):
    s = parse_spec({**HUB_TP, "runtime": {"tensorParallelSize": tp}})
    p = plan(s, built_with(s, shape), NOW)
    assert "Deployment" not in kinds(p) and reasons(p)["Degraded"] == ("True", "TensorParallelSizeInvalid")
    assert words in cond(p, "Degraded")["message"]
    ok = parse_spec({**HUB_TP, "runtime": {"tensorParallelSize": 2}})
    assert "Deployment" in kinds(plan(ok, built_with(ok, shape), NOW))


def test_a_record_without_a_shape_leaves_the_check_to_kiln_serve():
    """An engine recorded before builds reported their shape (or a report without one): the
    Deployment rolls out and ``kiln serve`` checks the size at start."""
    s = parse_spec({**HUB_TP, "runtime": {"tensorParallelSize": 4}})
    for seen in (built_with(s, None), observed(record=record(s.engine_hash))):
        p = plan(s, seen, NOW)
        assert "Deployment" in kinds(p) and reasons(p)["Degraded"] == ("False", "AsExpected")
