"""The reconciler against an in-memory API (no cluster): the issue's acceptance flow."""

import copy

import pytest

from kiln.operator import builders as b
from kiln.operator import constants as c
from kiln.operator.reconcile import Reconciler, ReconcilerConfig, job_state
from kiln.common.enginespec import engine_hash

from fakekube import FakeKube

NS = "team-a"


def make_ie(kube, spec, name="smollm2"):
    obj = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": NS}, "spec": spec}
    return kube.apply(obj)


def ie(kube, name="smollm2"):
    return kube.get(c.API_VERSION, c.KIND, NS, name)


def finish_job(kube, name, ok=True):
    if ok:
        st = {"succeeded": 1, "completionTime": "2026-01-01T00:00:00Z",
              "conditions": [{"type": "Complete", "status": "True"}]}
    else:
        st = {"failed": 2, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                           "message": "Job has reached the specified backoff limit"}]}
    kube.set_status("batch/v1", "Job", NS, name, st)


def cond(body, t):
    return next(x for x in body["status"]["conditions"] if x["type"] == t)


SPEC = {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "int4-awq"}, "replicas": 2}


@pytest.fixture
def kube():
    return FakeKube()


@pytest.fixture
def rec(kube):
    return Reconciler(kube, ReconcilerConfig(emit_events=True))


def test_build_then_deploy(kube, rec):
    make_ie(kube, SPEC)
    h = engine_hash(SPEC)
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_BUILDING and "Job" in out.applied and "PersistentVolumeClaim" in out.applied
    assert kube.get("apps/v1", "Deployment", NS, "smollm2") is None
    body = ie(kube)
    assert body["status"]["engineHash"] == h
    assert cond(body, "EngineBuilt")["status"] == "False" and cond(body, "Progressing")["reason"] == "Building"
    # the same state again: no new Job, no status write
    writes = len(kube.writes())
    out2 = rec.reconcile(ie(kube))
    assert not out2.status_written and "Job" not in out2.applied
    assert len(kube.list("batch/v1", "Job", NS)) == 1
    finish_job(kube, b.job_name("kiln-engine-cache", h))
    out3 = rec.reconcile(ie(kube))
    assert out3.built and out3.serving_hash == h
    dep = kube.get("apps/v1", "Deployment", NS, "smollm2")
    assert dep["spec"]["template"]["metadata"]["labels"][c.LABEL_ENGINE_HASH] == h
    assert dep["spec"]["replicas"] == 2
    assert kube.get("v1", "ConfigMap", NS, b.record_name("kiln-engine-cache", h)) is not None
    assert kube.get("v1", "Service", NS, "smollm2")["spec"]["ports"][0]["port"] == 8000
    body = ie(kube)
    assert body["status"]["phase"] == c.PHASE_DEPLOYING
    assert cond(body, "EngineBuilt")["reason"] == "BuildSucceeded"
    assert body["status"]["endpoint"] == "http://smollm2.team-a.svc:8000/v1"
    assert body["status"]["selector"] == b.selector_string({"name": "smollm2"})
    # pods become ready
    kube.set_status("apps/v1", "Deployment", NS, "smollm2",
                    {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2})
    rec.reconcile(ie(kube))
    body = ie(kube)
    assert body["status"]["phase"] == c.PHASE_READY and body["status"]["readyReplicas"] == 2
    assert cond(body, "Available")["status"] == "True" and cond(body, "Progressing")["status"] == "False"
    for x in body["status"]["conditions"]:
        assert x["observedGeneration"] == body["metadata"]["generation"] and x["lastTransitionTime"]
    events = [o for k, o in kube.objects.items() if k[1] == "Event"]
    assert {e["reason"] for e in events} >= {"BuildSucceeded", "MinimumReplicasAvailable"}
    # steady state: nothing changes
    before = copy.deepcopy(kube.objects)
    rec.reconcile(ie(kube))
    assert kube.objects == before


def test_a_running_build_reports_its_log_progress_and_is_polled(kube, rec):
    """The reconcile reads the running build pod's log tail (pods/log) and requeues itself
    while the build runs; a pod whose log cannot be read yet reports no progress."""
    from kiln.common.progress import BuildProgress, format_line

    make_ie(kube, SPEC)
    h = engine_hash(SPEC)
    rec.reconcile(ie(kube))
    job = b.job_name("kiln-engine-cache", h)
    kube.set_status("batch/v1", "Job", NS, job, {"active": 1, "startTime": "2026-01-01T00:00:00Z"})
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": job + "-abcde", "namespace": NS,
           "labels": b.build_labels("kiln-engine-cache", h), "creationTimestamp": "2026-01-01T00:00:01Z"}}
    kube.apply(pod)
    kube.set_status("v1", "Pod", NS, job + "-abcde", {"phase": "Running"})
    out = rec.reconcile(ie(kube))  # the container has not started: no log yet
    assert "stage" not in ie(kube)["status"]["build"] and out.requeue_after == rec.config.progress_seconds
    kube.logs[(NS, job + "-abcde")] = "\n".join([
        format_line(BuildProgress("load", 3, message="loading weights")), "some other line",
        format_line(BuildProgress("quantize", 41, 7, 30, "calibrate+quantize: layer 7/30")), "tail noise"])
    out = rec.reconcile(ie(kube))
    st = ie(kube)["status"]["build"]
    assert (st["state"], st["stage"], st["layer"], st["numLayers"], st["elapsedSeconds"]) == ("Running", "quantize", 7, 30, 41)
    assert ("log", "Pod", job + "-abcde") in kube.calls and out.requeue_after == rec.config.progress_seconds


def test_build_failure_degrades_without_a_deployment(kube, rec):
    make_ie(kube, SPEC)
    h = engine_hash(SPEC)
    rec.reconcile(ie(kube))
    finish_job(kube, b.job_name("kiln-engine-cache", h), ok=False)
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_DEGRADED
    body = ie(kube)
    d = cond(body, "Degraded")
    assert d["status"] == "True" and d["reason"] == "BuildFailed" and "BackoffLimitExceeded" in d["message"]
    assert cond(body, "EngineBuilt")["reason"] == "BuildFailed"
    assert kube.get("apps/v1", "Deployment", NS, "smollm2") is None
    assert len(kube.list("batch/v1", "Job", NS)) == 1  # no retry storm
    warnings = [o for k, o in kube.objects.items() if k[1] == "Event" and o["type"] == "Warning"]
    assert warnings


def test_spec_change_waits_for_the_new_engine_and_revert_reuses_the_old(kube, rec):
    make_ie(kube, SPEC)
    h1 = engine_hash(SPEC)
    rec.reconcile(ie(kube))
    finish_job(kube, b.job_name("kiln-engine-cache", h1))
    rec.reconcile(ie(kube))
    dep1 = kube.get("apps/v1", "Deployment", NS, "smollm2")
    spec2 = {**SPEC, "build": {"quantization": "fp8"}}
    h2 = engine_hash(spec2)
    assert h2 != h1
    make_ie(kube, spec2)
    out = rec.reconcile(ie(kube))
    assert out.hash == h2 and "Job" in out.applied and out.serving_hash == h1
    assert kube.get("apps/v1", "Deployment", NS, "smollm2") == dep1  # untouched
    assert ie(kube)["status"]["servingEngineHash"] == h1
    finish_job(kube, b.job_name("kiln-engine-cache", h2))
    rec.reconcile(ie(kube))
    dep2 = kube.get("apps/v1", "Deployment", NS, "smollm2")
    assert dep2["spec"]["template"]["metadata"]["labels"][c.LABEL_ENGINE_HASH] == h2
    # revert: the old engine's record exists, no new Job
    make_ie(kube, SPEC)
    jobs_before = len(kube.list("batch/v1", "Job", NS))
    out = rec.reconcile(ie(kube))
    assert out.built and "Job" not in out.applied and len(kube.list("batch/v1", "Job", NS)) == jobs_before
    dep3 = kube.get("apps/v1", "Deployment", NS, "smollm2")
    assert dep3["spec"]["template"]["metadata"]["labels"][c.LABEL_ENGINE_HASH] == h1


def test_engine_shared_across_resources_in_a_namespace(kube, rec):
    make_ie(kube, SPEC, "a")
    h = engine_hash(SPEC)
    rec.reconcile(ie(kube, "a"))
    finish_job(kube, b.job_name("kiln-engine-cache", h))
    rec.reconcile(ie(kube, "a"))
    make_ie(kube, SPEC, "b")
    out = rec.reconcile(ie(kube, "b"))
    assert out.built and "Job" not in out.applied
    assert cond(ie(kube, "b"), "EngineBuilt")["reason"] in ("EngineCached", "BuildSucceeded")


def test_resources_sharing_a_spec_share_one_build_job_owned_by_all(kube, rec):
    names = [f"r{i}" for i in range(20)]
    for n in names:
        make_ie(kube, SPEC, n)
    for _ in range(2):  # a second round sets the owners of the Job the first round created
        for n in names:
            rec.reconcile(ie(kube, n))
    jobs = kube.list("batch/v1", "Job", NS)
    assert len(jobs) == 1 and jobs[0]["metadata"]["name"] == b.job_name("kiln-engine-cache", engine_hash(SPEC))
    owners = {r["name"] for r in jobs[0]["metadata"]["ownerReferences"]}
    assert owners == set(names) and not any(r.get("controller") for r in jobs[0]["metadata"]["ownerReferences"])
    # one resource moving to another spec does not stop the build the others still need
    make_ie(kube, {**SPEC, "build": {"quantization": "fp8"}}, "r0")
    rec.reconcile(ie(kube, "r0"))
    assert b.job_name("kiln-engine-cache", engine_hash(SPEC)) in [j["metadata"]["name"] for j in kube.list("batch/v1", "Job", NS)]
    assert len(kube.list("batch/v1", "Job", NS)) == 2
    rec.reconcile(ie(kube, "r1"))
    job = kube.get("batch/v1", "Job", NS, b.job_name("kiln-engine-cache", engine_hash(SPEC)))
    assert "r0" not in {r["name"] for r in job["metadata"]["ownerReferences"]}


def test_long_names_sharing_63_characters_keep_their_own_children(kube, rec):
    a, b2 = "x" * 70 + "a", "x" * 70 + "b"
    for n in (a, b2):
        make_ie(kube, SPEC, n)
    for _ in range(3):
        for n in (a, b2):
            rec.reconcile(ie(kube, n))
    deps = {d["metadata"]["name"] for d in kube.list("apps/v1", "Deployment", NS)} | \
        {s["metadata"]["name"] for s in kube.list("v1", "Service", NS)}
    assert len(kube.list("batch/v1", "Job", NS)) == 1
    assert not [x for x in kube.writes() if x[0] == "delete"]
    assert len(deps) == 2 and all(len(n) <= 63 for n in deps)
    sel = {ie(kube, n)["status"]["selector"] for n in (a, b2)}
    assert len(sel) == 2


class RefusingKube(FakeKube):
    """Refuses applies of one kind as the API server refuses an invalid object."""

    def __init__(self, kind, status=422, reason="Invalid", message="spec.ports: bad"):
        super().__init__()
        self.refuse = (kind, status, reason, message)

    def apply(self, obj, subresource=None, **kw):
        from kiln.operator.kube import ApiError

        if obj["kind"] == self.refuse[0] and subresource is None:
            raise ApiError(*self.refuse[1:])
        return super().apply(obj, subresource=subresource, **kw)


def test_a_child_the_api_server_refuses_degrades_with_its_message_and_an_event():
    kube = RefusingKube("Service", message='Service "x.y" is invalid: metadata.name: Invalid value')
    rec = Reconciler(kube)
    make_ie(kube, SPEC)
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_DEGRADED
    d = cond(ie(kube), "Degraded")
    assert d["status"] == "True" and d["reason"] == "ServiceRejected" and "metadata.name: Invalid value" in d["message"]
    events = kube.list("v1", "Event", NS)
    assert any(e["reason"] == "ServiceRejected" and e["type"] == "Warning" for e in events)


def test_a_forbidden_child_is_in_the_status_and_retried():
    from kiln.operator.kube import ApiError

    kube = RefusingKube("ConfigMap", 403, "Forbidden", "configmaps is forbidden")
    rec = Reconciler(kube)
    make_ie(kube, SPEC)
    rec.reconcile(ie(kube))
    finish_job(kube, b.job_name("kiln-engine-cache", engine_hash(SPEC)))
    with pytest.raises(ApiError):
        rec.reconcile(ie(kube))
    assert cond(ie(kube), "Degraded")["reason"] == "ConfigMapRejected"


def test_superseded_running_build_is_stopped(kube, rec):
    make_ie(kube, SPEC)
    h1 = engine_hash(SPEC)
    rec.reconcile(ie(kube))
    make_ie(kube, {**SPEC, "build": {"quantization": "fp8"}})
    rec.reconcile(ie(kube))
    names = [j["metadata"]["name"] for j in kube.list("batch/v1", "Job", NS)]
    assert b.job_name("kiln-engine-cache", h1) not in names and len(names) == 1


def test_suspend_scales_to_zero_and_stops_builds(kube, rec):
    make_ie(kube, SPEC)
    h = engine_hash(SPEC)
    rec.reconcile(ie(kube))
    make_ie(kube, {**SPEC, "suspend": True})
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_SUSPENDED and kube.list("batch/v1", "Job", NS) == []
    rec.reconcile(ie(kube))
    assert kube.list("batch/v1", "Job", NS) == []  # stays stopped
    make_ie(kube, SPEC)
    rec.reconcile(ie(kube))
    finish_job(kube, b.job_name("kiln-engine-cache", h))
    rec.reconcile(ie(kube))
    assert kube.get("apps/v1", "Deployment", NS, "smollm2")["spec"]["replicas"] == 2
    make_ie(kube, {**SPEC, "suspend": True})
    rec.reconcile(ie(kube))
    assert kube.get("apps/v1", "Deployment", NS, "smollm2")["spec"]["replicas"] == 0


def test_autoscaling_modes_own_replicas_exclusively(kube):
    wish = {"n": None}
    def scaler(key):  # the builtin autoscaler answers for the resource it is asked about only
        if key != f"{NS}/smollm2":
            return None, None
        return wish["n"], {"desiredReplicas": wish["n"]} if wish["n"] else None

    rec = Reconciler(kube, scaler=scaler)
    spec = {**SPEC, "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 5}}
    make_ie(kube, spec)
    h = engine_hash(spec)
    rec.reconcile(ie(kube))
    finish_job(kube, b.job_name("kiln-engine-cache", h))
    rec.reconcile(ie(kube))
    assert kube.get("autoscaling/v2", "HorizontalPodAutoscaler", NS, "smollm2") is not None
    kube.objects[("apps/v1", "Deployment", NS, "smollm2")]["spec"]["replicas"] = 4  # the HPA scaled
    rec.reconcile(ie(kube))
    assert kube.get("apps/v1", "Deployment", NS, "smollm2")["spec"]["replicas"] == 4  # not fought
    make_ie(kube, {**spec, "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 5}})
    wish["n"] = 3
    rec.reconcile(ie(kube))
    assert kube.get("autoscaling/v2", "HorizontalPodAutoscaler", NS, "smollm2") is None
    assert kube.get("apps/v1", "Deployment", NS, "smollm2")["spec"]["replicas"] == 3
    assert ie(kube)["status"]["autoscaler"]["desiredReplicas"] == 3
    wish["n"] = 99
    rec.reconcile(ie(kube))
    assert kube.get("apps/v1", "Deployment", NS, "smollm2")["spec"]["replicas"] == 5  # clamped


def test_invalid_spec_is_degraded_not_crashing(kube, rec):
    make_ie(kube, {"model": {}, "build": {}})
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_DEGRADED and out.hash is None
    assert cond(ie(kube), "Degraded")["reason"] == "InvalidSpec"


def test_model_len_above_the_build_limit_is_invalid(kube, rec):
    """runtime.maxModelLen > build.maxSeqLen would crash every pod at start (the runtime refuses
    to serve past an engine's build limit): a Degraded / InvalidSpec condition instead."""
    make_ie(kube, {**SPEC, "build": {**SPEC.get("build", {}), "maxSeqLen": 1024}, "runtime": {"maxModelLen": 2048}})
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_DEGRADED and out.hash is None
    d = cond(ie(kube), "Degraded")
    assert d["reason"] == "InvalidSpec" and "maxModelLen 2048" in d["message"]
    assert kube.get("apps/v1", "Deployment", NS, "smollm2") is None
    make_ie(kube, {**SPEC, "build": {**SPEC.get("build", {}), "maxSeqLen": 1024}, "runtime": {"maxModelLen": 1024}})
    assert rec.reconcile(ie(kube)).hash is not None


def test_tensor_parallel_size_that_does_not_split_the_heads_is_invalid(kube, rec):
    """runtime.tensorParallelSize 2 on the builtin SmolLM2 (9 heads, 3 KV heads) would crash
    every pod: Degraded / InvalidSpec naming the heads, before any Job or pod; 3 splits them."""
    make_ie(kube, {**SPEC, "runtime": {"tensorParallelSize": 2}})
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_DEGRADED and out.hash is None
    d = cond(ie(kube), "Degraded")
    assert d["reason"] == "InvalidSpec" and "tensorParallelSize 2 does not split the model's 9 attention heads" \
        in d["message"]
    assert kube.list("batch/v1", "Job", NS) == [] and kube.get("apps/v1", "Deployment", NS, "smollm2") is None
    make_ie(kube, {**SPEC, "runtime": {"tensorParallelSize": 3}})
    assert rec.reconcile(ie(kube)).hash is not None


def test_tensor_parallel_size_is_checked_against_the_built_engine(kube, rec):
    """A Hub model's heads are known once its engine is built: the build pod's report (the
    termination message ``kiln build`` writes) gives the shape, the record keeps it, and a
    size that does not split it is Degraded / TensorParallelSizeInvalid with no Deployment;
    the spec fixed to a size that splits it rolls out without another build."""
    from kiln.common.enginecache import format_build_report

    spec = {"model": {"huggingFace": {"repo": "org/llama"}}, "replicas": 1, "runtime": {"tensorParallelSize": 4}}
    make_ie(kube, spec)
    h = rec.reconcile(ie(kube)).hash
    jname = b.job_name("kiln-engine-cache", h)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{jname}-x", "namespace": NS,
                                                           "labels": b.build_labels("kiln-engine-cache", h)}}
    kube.apply(pod)
    shape = {"numAttentionHeads": 6, "numKeyValueHeads": 2, "headDim": 64, "intermediateSize": 1024}
    kube.set_status("v1", "Pod", NS, pod["metadata"]["name"], {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 0, "finishedAt": "2026-01-01T00:00:00Z", "message": format_build_report(h, 10, shape=shape)}}}]})
    finish_job(kube, jname)
    out = rec.reconcile(ie(kube))
    assert out.built and out.phase == c.PHASE_DEGRADED
    assert kube.get("apps/v1", "Deployment", NS, "smollm2") is None
    assert kube.get("v1", "Service", NS, "smollm2") is not None
    d = cond(ie(kube), "Degraded")
    assert d["reason"] == "TensorParallelSizeInvalid" and "runtime.tensorParallelSize 4 does not split the " \
        "model's 6 attention heads and 2 KV heads" in d["message"]
    assert cond(ie(kube), "EngineBuilt")["status"] == "True"
    make_ie(kube, {**spec, "runtime": {"tensorParallelSize": 2}})
    out = rec.reconcile(ie(kube))
    assert out.hash == h and out.phase == c.PHASE_DEPLOYING
    dep = kube.get("apps/v1", "Deployment", NS, "smollm2")
    assert "--tensor-parallel-size" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert cond(ie(kube), "Degraded")["status"] == "False"


@pytest.mark.parametrize("runtime, build, word", [
    ({"maxNumSeqs": 128}, {}, "runtime.maxNumSeqs 128 is larger than build.maxBatchSize 64"),
    ({"maxNumBatchedTokens": 16384}, {"maxNumTokens": 4096}, "runtime.maxNumBatchedTokens 16384 is larger than "
                                                              "build.maxNumTokens 4096"),
])
def test_batch_above_the_build_limits_is_invalid(kube, rec, runtime, build, word):
    """kiln serve refuses --max-num-seqs / --max-num-batched-tokens past the engine's
    --max-batch-size / --max-num-tokens: a Degraded / InvalidSpec condition, no Deployment."""
    make_ie(kube, {**SPEC, "build": {**SPEC.get("build", {}), **build}, "runtime": runtime})
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_DEGRADED and out.hash is None
    assert word in cond(ie(kube), "Degraded")["message"]
    assert kube.get("apps/v1", "Deployment", NS, "smollm2") is None


def test_missing_existing_claim_degrades(kube, rec):
    make_ie(kube, {**SPEC, "storage": {"claimName": "mine", "create": False}})
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_DEGRADED and kube.list("batch/v1", "Job", NS) == []
    assert cond(ie(kube), "Degraded")["reason"] == "ClaimNotFound"


def test_job_state():
    assert job_state(None)[0] == "Pending"
    assert job_state({"status": {"active": 1}})[0] == "Running"
    assert job_state({"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}})[:2] \
        == ("Failed", "DeadlineExceeded")


def test_a_serving_spec_edit_reports_the_rollout_at_once(kube, rec):
    """A runtime knob changes only the pod template: the apply starts a new Deployment
    generation, and the status written in the same reconcile already says RollingOut."""
    make_ie(kube, SPEC)
    h = engine_hash(SPEC)
    rec.reconcile(ie(kube))
    finish_job(kube, b.job_name("kiln-engine-cache", h))
    rec.reconcile(ie(kube))
    kube.set_status("apps/v1", "Deployment", NS, "smollm2",
                    {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2})
    assert rec.reconcile(ie(kube)).phase == c.PHASE_READY
    make_ie(kube, {**SPEC, "runtime": {"maxNumSeqs": 32}})
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_DEPLOYING and out.replicas == 2
    assert kube.get("apps/v1", "Deployment", NS, "smollm2")["metadata"]["generation"] == 2
    assert cond(ie(kube), "Progressing")["reason"] == "RollingOut"
    assert cond(ie(kube), "Available")["status"] == "True"  # the old pods keep serving


def test_gateway_children_follow_discovery_and_the_picker_is_not_the_serving_deployment(kube, rec):
    spec = {**SPEC, "gateway": {"httpRoute": {"parentRefs": [{"name": "gw"}]}, "inferencePool": {"enabled": True}}}
    make_ie(kube, spec)
    rec.reconcile(ie(kube))
    assert cond(ie(kube), "Exposed")["reason"] == "GatewayAPINotInstalled"
    # the CRDs appear: found at the next reconcile (a missing kind is asked again)
    kube.served = {"gateway.networking.k8s.io/v1": {"HTTPRoute"}, "inference.networking.k8s.io/v1": {"InferencePool"}}
    out = rec.reconcile(ie(kube))
    assert out.phase == c.PHASE_BUILDING  # the picker's Deployment is not taken for the engine's
    assert kube.get("apps/v1", "Deployment", NS, "smollm2") is None
    assert kube.get("apps/v1", "Deployment", NS, "smollm2-epp") is not None
    assert kube.get("gateway.networking.k8s.io/v1", "HTTPRoute", NS, "smollm2") is not None
    assert cond(ie(kube), "Exposed")["status"] == "True"
    finish_job(kube, b.job_name("kiln-engine-cache", engine_hash(spec)))
    out = rec.reconcile(ie(kube))
    assert out.serving_hash == engine_hash(spec) and kube.get("apps/v1", "Deployment", NS, "smollm2") is not None
    # a kind found is trusted for served_ttl: no discovery call per reconcile
    before = sum(1 for x in kube.calls if x[0] == "discover")
    rec.reconcile(ie(kube))
    assert sum(1 for x in kube.calls if x[0] == "discover") == before
