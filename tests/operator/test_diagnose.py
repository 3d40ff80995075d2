"""Failures after the build, on plain data: what the kubelet, the scheduler and the Deployment
controller report becomes the InferenceEngine's Degraded reason and message (diagnose.py and
the planner)."""

from kiln.operator import builders as b
from kiln.operator import diagnose as d
from kiln.operator.plan import Observed, plan
from kiln.operator.spec import parse_spec

NOW = "2026-01-02T03:04:05Z"
OWNER = {"name": "smollm2", "namespace": "team-a", "uid": "u-1"}
SPEC = parse_spec({"model": {"builtin": "smollm2-135m-instruct"}})
H = SPEC.engine_hash
CLAIM = "kiln-engine-cache"


def pod(name, *, waiting=None, message="", restarts=0, last=None, ready=False, unschedulable_since=None):
    cs = {"name": "kiln", "restartCount": restarts, "ready": ready,
          "state": {"waiting": {"reason": waiting, "message": message}} if waiting else {"running": {}}}
    if last:
        cs["lastState"] = {"terminated": last}
    st = {"containerStatuses": [cs]}
    if unschedulable_since:
        st = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                              "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                              "lastTransitionTime": unschedulable_since}]}
    return {"metadata": {"name": name}, "status": st}


def test_crash_loop_carries_the_last_termination_message():
    p, wait = d.pod_problem(pod("p", waiting="CrashLoopBackOff", message="back-off 40s", restarts=3,
                                last={"exitCode": 1, "reason": "Error", "message": "engine folder missing"}), NOW)
    assert wait is None and p.reason == "CrashLoopBackOff"
    assert "engine folder missing" in p.message and "exit code 1" in p.message and "3 restarts" in p.message


def test_restarting_between_back_offs_is_still_a_crash_loop():
    p, _ = d.pod_problem(pod("p", restarts=4, last={"exitCode": 137, "reason": "Error"}), NOW)
    assert p.reason == "CrashLoopBackOff" and "exit code 137" in p.message
    assert d.pod_problem(pod("p", restarts=4, ready=True), NOW) == (None, None)


def test_missing_secret_is_create_container_config_error():
    p, _ = d.pod_problem(pod("p", waiting="CreateContainerConfigError", message='secret "hf" not found'), NOW)
    assert p.reason == "CreateContainerConfigError" and 'secret "hf" not found' in p.message


def test_unschedulable_counts_after_a_grace():
    fresh, wait = d.pod_problem(pod("p", unschedulable_since="2026-01-02T03:04:00Z"), NOW)
    assert fresh is None and 0 < wait <= d.UNSCHEDULABLE_GRACE_SECONDS
    p, _ = d.pod_problem(pod("p", unschedulable_since="2026-01-02T03:00:00Z"), NOW)
    assert p.reason == "Unschedulable" and "Insufficient nvidia.com/gpu" in p.message


def test_failed_build_cause_is_the_newest_termination_message():
    pods = [{"status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 2, "finishedAt": f"2026-01-01T00:0{i}:00Z", "message": f"kiln build: attempt {i}"}}}]}}
        for i in range(2)]
    assert d.failed_build_cause(pods) == "exit code 2: kiln build: attempt 1"


def test_deployment_past_its_progress_deadline():
    dep = {"status": {"conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                      "message": 'ReplicaSet "x" has timed out progressing.'}]}}
    assert d.deployment_problem(dep).reason == "ProgressDeadlineExceeded"


def _served(**fields):
    dep = b.deployment(SPEC, H, OWNER, replicas=1)
    dep["metadata"]["generation"] = 1
    dep["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 0}
    record = {"metadata": {"name": b.record_name(CLAIM, H)}, "data": {"engineHash": H}}
    return Observed(owner=OWNER, generation=2, claim_exists=True, record=record, deployment=dep, **fields)


def test_plan_degrades_on_a_crash_looping_serving_pod():
    p = plan(SPEC, _served(serving_pods=(pod("s-1", waiting="CrashLoopBackOff", restarts=5,
                                                 last={"exitCode": 1, "message": "--max-model-len too large"}),)), NOW)
    deg = next(x for x in p.status["conditions"] if x["type"] == "Degraded")
    assert p.phase == "Degraded" and deg["reason"] == "CrashLoopBackOff" and "--max-model-len too large" in deg["message"]


def test_plan_rechecks_a_pending_pod_when_its_grace_ends():
    p = plan(SPEC, _served(serving_pods=(pod("s-1", unschedulable_since="2026-01-02T03:04:00Z"),)), NOW)
    assert p.phase == "Deploying" and 0 < p.requeue_after <= d.UNSCHEDULABLE_GRACE_SECONDS


def test_plan_degrades_on_an_unschedulable_build_pod_and_a_failed_build_names_the_cause():
    job = {"metadata": {"name": b.job_name(CLAIM, H), "labels": b.build_labels(CLAIM, H)}, "status": {"active": 1}}
    p = plan(SPEC, Observed(owner=OWNER, claim_exists=True, jobs=(job,),
                            build_pods=(pod("b-1", unschedulable_since="2026-01-02T03:00:00Z"),)), NOW)
    deg = next(x for x in p.status["conditions"] if x["type"] == "Degraded")
    assert deg["reason"] == "BuildUnschedulable" and "Insufficient" in deg["message"]
    failed = {**job, "status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True",
                                                               "reason": "BackoffLimitExceeded"}]}}
    dead = {"metadata": {"name": "b-1"}, "status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 2, "message": "kiln build: --group-size 128 does not divide 576"}}}]}}
    p = plan(SPEC, Observed(owner=OWNER, claim_exists=True, jobs=(failed,), build_pods=(dead,)), NOW)
    deg = next(x for x in p.status["conditions"] if x["type"] == "Degraded")
    assert deg["reason"] == "BuildFailed" and "BackoffLimitExceeded" in deg["message"] and "does not divide 576" in deg["message"]
