"""runtime.speculative: CRD rules, the typed spec, the kiln serve flags (read by the real
parser and turned into the runtime's own SpeculativeConfig), the draft model as a second
engine (its hash, its build Job, the plan gating the pods on both engines, the status) and the
engine cache cleanup keeping the draft."""

import argparse

import pytest

from kiln.common.enginespec import BuildSpec, engine_hash
from kiln.operator import builders as b
from kiln.operator import constants as c
from kiln.operator.plan import Observed, Peer, plan
from kiln.operator.spec import EngineSpecError, InvalidSpec, parse_spec
from kiln.operator.speculative import LABEL_DRAFT_ENGINE_HASH, SPECULATIVE_METHODS

from crdcheck import admit

NOW = "2026-01-02T03:04:05Z"
OWNER = {"name": "smollm2", "namespace": "team-a", "uid": "u-1"}
CLAIM = "kiln-engine-cache"
MODEL = {"builtin": "smollm2-135m-instruct"}
NGRAM = {"model": MODEL, "runtime": {"speculative": {"method": "ngram", "numTokens": 6, "promptLookupMin": 3,
                                                       "promptLookupMax": 7, "disableByBatchSize": 4}},
         "resources": {"gpus": 0}}
DRAFT = {"model": MODEL, "build": {"maxSeqLen": 2048, "calibrationSamples": 16},
         "runtime": {"speculative": {"method": "draft", "numTokens": 3, "draftModel": {"quantization": "int4-awq"}}}}
EAGLE = {"model": {"huggingFace": {"repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f"}},
         "runtime": {"speculative": {"method": "eagle", "draftModel": {
             "pvc": {"claimName": "heads", "path": "eagle3-llama-3.1-8b"}}}}}


def _ie(spec):
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"}, "spec": spec}


def container(obj):
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_methods_are_the_runtimes():
    cfg = pytest.importorskip("kiln.runtime.spec_decode.config")
    assert SPECULATIVE_METHODS == cfg.SPECULATIVE_METHODS


@pytest.mark.parametrize("spec", [NGRAM, DRAFT, EAGLE, {"model": MODEL, "runtime": {"speculative": {"method": "ngram"}}},
                                  {"model": MODEL, "runtime": {"speculative": {"method": "draft", "draftModel": {
                                      "huggingFace": {"repo": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                                      "quantization": "int4-gptq", "groupSize": 64}}}}])
def test_the_crd_admits_and_the_operator_parses(spec):
    obj, errors = admit(_ie(spec))
    assert errors == []
    assert parse_spec(obj["spec"]).runtime.speculative is not None


@pytest.mark.parametrize("sp, message", [
    ({"method": "draft"}, "draftModel is required for method draft and eagle"),
    ({"method": "eagle"}, "draftModel is required for method draft and eagle"),
    ({"method": "ngram", "draftModel": {"builtin": "smollm2-135m-instruct"}}, "method ngram uses no model"),
    ({"method": "ngram", "promptLookupMin": 6, "promptLookupMax": 3}, "must not be larger than promptLookupMax"),
    ({"method": "draft", "promptLookupMin": 2, "draftModel": {"quantization": "int4-awq"}}, "apply to method ngram only"),
    ({"method": "eagle", "draftModel": {"builtin": "smollm2-135m-instruct"}}, "an EAGLE head comes from pvc or huggingFace"),
    ({"method": "eagle", "draftModel": {"pvc": {"claimName": "h", "path": "x"}, "quantization": "int4-awq"}},
     "an EAGLE head comes from pvc or huggingFace"),
    ({"method": "draft", "draftModel": {"builtin": "smollm2-135m-instruct", "pvc": {"claimName": "h", "path": "x"}}},
     "at most one source"),
])
def test_cel_rules_and_the_parser_refuse_the_same(sp, message):
    """The API server refuses these; the operator's parser refuses them too (a spec written
    before the CRD had the rules, or a server without CEL), naming the field."""
    _, errors = admit(_ie({"model": MODEL, "runtime": {"speculative": sp}}))
    assert any(message in e for e in errors), errors
    with pytest.raises(EngineSpecError, match="runtime.speculative"):
        parse_spec({"model": MODEL, "runtime": {"speculative": sp}})


@pytest.mark.parametrize("sp", [{}, {"method": "medusa"}, {"method": "ngram", "numTokens": 0},
                                {"method": "ngram", "numTokens": 17}, {"method": "ngram", "disableByBatchSize": 0}])
def test_enums_and_bounds_are_the_crds(sp):
    _, errors = admit(_ie({"model": MODEL, "runtime": {"speculative": sp}}))
    assert errors
    with pytest.raises(EngineSpecError):
        parse_spec({"model": MODEL, "runtime": {"speculative": sp}})


def test_tensor_parallel_speculation_is_an_invalid_spec_before_any_pod():
    raw = {**NGRAM, "runtime": {**NGRAM["runtime"], "tensorParallelSize": 3}}
    with pytest.raises(EngineSpecError, match="not served with runtime.tensorParallelSize > 1"):
        parse_spec(raw)
    p = plan(InvalidSpec("runtime.speculative: not served with runtime.tensorParallelSize > 1"),
             Observed(owner=OWNER, generation=1), NOW)
    assert p.apply == () and p.phase == c.PHASE_DEGRADED
    assert {x["type"]: x["reason"] for x in p.status["conditions"]}[c.COND_DEGRADED] == "InvalidSpec"


def test_serve_flags_are_read_by_the_real_kiln_serve_parser_and_the_runtimes_config():
    cli = pytest.importorskip("kiln.runtime.cli")
    pytest.importorskip("torch")
    cases = [(NGRAM, ("ngram", 6, None, 3, 7, 4)), (DRAFT, ("draft", 3, "/engines/{draft}", 2, 5, None)),
             (EAGLE, ("eagle", 4, "/speculative/eagle3-llama-3.1-8b", 2, 5, None))]
    for raw, (method, k, model, lo, hi, off) in cases:
        spec = parse_spec(raw)
        h = spec.engine_hash
        ctr = container(b.deployment(spec, h, OWNER, replicas=1))
        ns = cli.build_parser().parse_args(ctr["command"][1:] + ctr["args"])
        assert ns.engine == f"/engines/{h}"
        cfg = cli.engine_args_from(ns).speculative  # the runtime's own checks of the combination
        want_model = model.format(draft=spec.draft_hash) if model else None
        assert (cfg.method, cfg.num_speculative_tokens, cfg.model, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                cfg.disable_by_batch_size) == (method, k, want_model, lo, hi, off)
    plain = container(b.deployment(parse_spec({"model": MODEL}), "0" * 16, OWNER, replicas=1))["args"]
    assert not any(a.startswith("--speculative") for a in plain)


def test_an_eagle_head_is_mounted_read_only_from_its_claim():
    spec = parse_spec(EAGLE)
    dep = b.deployment(spec, spec.engine_hash, OWNER, replicas=1)
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "speculative", "persistentVolumeClaim": {"claimName": "heads", "readOnly": True}} in pod["volumes"]
    assert {"name": "speculative", "mountPath": "/speculative", "readOnly": True} in container(dep)["volumeMounts"]
    assert spec.draft_hash is None and spec.engine_hashes == (spec.engine_hash,)  # a head is not built
    # a head on the engine cache claim is read where that claim is mounted already
    same = parse_spec({**EAGLE, "runtime": {"speculative": {"method": "eagle", "draftModel": {
        "pvc": {"claimName": CLAIM, "path": "heads/eagle3"}}}}})
    dep = b.deployment(same, same.engine_hash, OWNER, replicas=1)
    assert "speculative" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    args = container(dep)["args"]
    assert args[args.index("--speculative-model") + 1] == "/engines/heads/eagle3"
    with pytest.raises(EngineSpecError, match="leaves the claim"):
        parse_spec({**EAGLE, "runtime": {"speculative": {"method": "eagle", "draftModel": {
            "pvc": {"claimName": "h", "path": "../x"}}}}})


def test_the_draft_is_its_own_engine_and_the_target_keeps_its_hash():
    spec = parse_spec(DRAFT)
    plain = {k: v for k, v in DRAFT.items() if k != "runtime"}
    assert spec.engine_hash == engine_hash(plain)  # the same target bytes serve with or without a draft
    d = spec.runtime.speculative.draft_engine
    assert d.source == spec.engine.source and d.quantization == "int4-awq" and d.calibration_samples == 16
    assert (d.max_seq_len, d.max_batch_size, d.max_num_tokens) == (2048, 64, 8192)  # the target's limits
    assert spec.draft_hash == engine_hash({"model": MODEL, "build": {"quantization": "int4-awq", "maxSeqLen": 2048,
                                                                     "calibrationSamples": 16}})
    assert spec.engine_hashes == (spec.engine_hash, spec.draft_hash)
    # its source and build settings are in its hash; numTokens is a serving knob, in neither
    other = {**DRAFT, "runtime": {"speculative": {**DRAFT["runtime"]["speculative"],
                                                  "draftModel": {"quantization": "int4-gptq"}}}}
    assert parse_spec(other).draft_hash != spec.draft_hash
    k = {**DRAFT, "runtime": {"speculative": {**DRAFT["runtime"]["speculative"], "numTokens": 8}}}
    assert parse_spec(k).draft_hash == spec.draft_hash and parse_spec(k).engine_hash == spec.engine_hash
    with pytest.raises(EngineSpecError, match="the served engine itself"):
        parse_spec({"model": MODEL, "runtime": {"speculative": {"method": "draft", "draftModel": {}}}})
    with pytest.raises(EngineSpecError, match="runtime.speculative.draftModel: build.groupSize"):
        parse_spec({"model": MODEL, "runtime": {"speculative": {"method": "draft", "draftModel": {
            "quantization": "int4-awq", "groupSize": 100}}}})


def test_the_draft_build_job_runs_kiln_build_for_the_draft_hash():
    build = pytest.importorskip("kiln.runtime.build_cli")
    from kiln.operator.speculative import draft_build_spec

    raw = {**DRAFT, "runtime": {"speculative": {"method": "draft", "draftModel": {
        "pvc": {"claimName": "models", "path": "smollm2-360m"}, "quantization": "int4-awq"}}}}
    spec = parse_spec(raw)
    dh = spec.draft_hash
    job = b.build_job(draft_build_spec(spec), dh, [OWNER])
    assert job["metadata"]["name"] == b.job_name(CLAIM, dh)
    pod = job["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    a = build.add_build_args(argparse.ArgumentParser()).parse_args(container(job)["args"])
    got = BuildSpec.from_cli(a.model, quantization=a.quantization, group_size=a.group_size,
                             calibration_samples=a.calibration_samples, max_seq_len=a.max_seq_len,
                             max_batch_size=a.max_batch_size, max_num_tokens=a.max_num_tokens)
    assert got.hash() == dh and a.output == f"/engines/{dh}"


def _job(hash_, state):
    st = {"running": {"active": 1, "startTime": "2026-01-01T00:00:00Z"},
          "succeeded": {"succeeded": 1, "completionTime": "2026-01-01T01:00:00Z",
                        "conditions": [{"type": "Complete", "status": "True"}]},
          "failed": {"failed": 2, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                  "message": "Job has reached the specified backoff limit"}]}}[state]
    return {"metadata": {"name": b.job_name(CLAIM, hash_), "labels": b.build_labels(CLAIM, hash_)}, "status": st}


def _record(hash_):
    return {"metadata": {"name": b.record_name(CLAIM, hash_)}, "data": {"engineHash": hash_, "sizeBytes": "1234"}}


def test_the_pods_wait_for_both_engines_and_serve_the_draft():
    spec = parse_spec(DRAFT)
    h, dh = spec.engine_hash, spec.draft_hash
    # neither engine: two build Jobs, one per hash; no Deployment
    p = plan(spec, Observed(owner=OWNER, generation=1, claim_exists=True), NOW)
    jobs = [o for o in p.apply if o["kind"] == "Job"]
    assert [j["metadata"]["name"] for j in jobs] == [b.job_name(CLAIM, h), b.job_name(CLAIM, dh)]
    assert "--quantization" in container(jobs[1])["args"] and p.manifest("Deployment") is None
    assert p.status["engine"]["draft"]["hash"] == dh and p.phase == c.PHASE_BUILDING
    # the target is complete, the draft builds: still no pods, the condition says the draft builds
    p = plan(spec, Observed(owner=OWNER, generation=1, claim_exists=True, record=_record(h),
                            jobs=(_job(dh, "running"),)), NOW)
    assert p.manifest("Deployment") is None and not p.built and p.phase == c.PHASE_BUILDING
    assert p.status["engine"]["hash"] == h and p.status["engine"]["draft"]["state"] == "Running"
    built = {x["type"]: x for x in p.status["conditions"]}[c.COND_ENGINE_BUILT]
    assert built["status"] == "False" and b.job_name(CLAIM, dh) in built["message"]
    # the draft's Job succeeded: its record is written and the pods start with both engines
    p = plan(spec, Observed(owner=OWNER, generation=1, claim_exists=True, record=_record(h),
                            jobs=(_job(dh, "succeeded"),)), NOW)
    rec = next(o for o in p.apply if o["kind"] == "ConfigMap")
    assert rec["metadata"]["name"] == b.record_name(CLAIM, dh)
    dep = p.manifest("Deployment")
    assert dep is not None and p.built
    assert dep["spec"]["template"]["metadata"]["labels"][LABEL_DRAFT_ENGINE_HASH] == dh
    args = container(dep)["args"]
    assert args[args.index("--speculative-model") + 1] == f"/engines/{dh}"
    p = plan(spec, Observed(owner=OWNER, generation=1, claim_exists=True, record=_record(h),
                            draft_record=_record(dh)), NOW)
    assert p.status["engine"]["draft"] == {"hash": dh, "state": "Cached", "jobName": "", "sizeBytes": 1234}


def test_a_failed_draft_build_degrades_the_resource():
    spec = parse_spec(DRAFT)
    p = plan(spec, Observed(owner=OWNER, generation=1, claim_exists=True, record=_record(spec.engine_hash),
                            jobs=(_job(spec.draft_hash, "failed"),)), NOW)
    deg = {x["type"]: x for x in p.status["conditions"]}[c.COND_DEGRADED]
    assert p.phase == c.PHASE_DEGRADED and deg["reason"] == "BuildFailed" and deg["message"].startswith("draft model:")
    assert p.status["engine"]["draft"]["state"] == "Failed" and p.manifest("Deployment") is None


def test_a_peers_draft_build_is_not_stopped_and_a_superseded_one_is():
    """Draft builds are shared like any build: one needed by a peer runs on; one nobody needs
    any more (this resource's draft changed) is stopped."""
    spec = parse_spec(DRAFT)
    peer_spec = parse_spec({**DRAFT, "runtime": {"speculative": {"method": "draft", "draftModel": {
        "quantization": "int4-gptq"}}}})
    peer = Peer({"name": "other", "namespace": "team-a", "uid": "u-2"}, CLAIM, peer_spec.engine_hash,
                draft_hash=peer_spec.draft_hash)
    me = Peer(OWNER, CLAIM, spec.engine_hash, draft_hash=spec.draft_hash)
    observed = Observed(owner=OWNER, generation=1, claim_exists=True, record=_record(spec.engine_hash),
                        jobs=(_job(peer_spec.draft_hash, "running"), _job(spec.draft_hash, "running")),
                        peers=(me, peer))
    assert plan(spec, observed, NOW).delete == ()
    alone = plan(spec, Observed(**{**observed.__dict__, "peers": (me,)}), NOW)
    assert [r.name for r in alone.delete] == [b.job_name(CLAIM, peer_spec.draft_hash)]


def test_the_engine_cache_cleanup_keeps_a_served_draft():
    from fakekube import FakeKube

    from kiln.operator.enginegc import EngineJanitor, GcSettings

    spec = parse_spec(DRAFT)
    kube = FakeKube()
    kube.create({"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "smollm2", "namespace": "team-a",
                                                                          "uid": "u-1"}, "spec": DRAFT})
    kube.create(b.deployment(spec, spec.engine_hash, OWNER, replicas=1))
    users = EngineJanitor(kube, GcSettings()).users("team-a")
    assert users[(CLAIM, spec.draft_hash)] == ["team-a/deployment/smollm2", "team-a/smollm2"]
    assert (CLAIM, spec.engine_hash) in users


def test_the_reconciler_builds_both_engines_then_serves():
    """Observe -> plan -> act against the in-memory API: two build Jobs, two records, then the
    Deployment with the draft; a tensor-parallel speculative spec is InvalidSpec and touches nothing."""
    from fakekube import FakeKube

    from kiln.operator.reconcile import Reconciler, ReconcilerConfig

    kube = FakeKube()
    rec = Reconciler(kube, ReconcilerConfig(emit_events=False))
    kube.apply({"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "smollm2", "namespace": "team-a"},
                "spec": DRAFT})
    spec = parse_spec(DRAFT)
    h, dh = spec.engine_hash, spec.draft_hash

    def body():
        return kube.get(c.API_VERSION, c.KIND, "team-a", "smollm2")

    out = rec.reconcile(body())
    assert out.phase == c.PHASE_BUILDING and not out.built
    for hash_ in (h, dh):
        assert kube.get("batch/v1", "Job", "team-a", b.job_name(CLAIM, hash_)) is not None
        kube.set_status("batch/v1", "Job", "team-a", b.job_name(CLAIM, hash_), {
            "succeeded": 1, "completionTime": "2026-01-01T00:00:00Z",
            "conditions": [{"type": "Complete", "status": "True"}]})
    out = rec.reconcile(body())
    assert out.built and out.serving_hash == h
    assert kube.get("v1", "ConfigMap", "team-a", b.record_name(CLAIM, dh)) is not None
    dep = kube.get("apps/v1", "Deployment", "team-a", "smollm2")
    assert f"/engines/{dh}" in container(dep)["args"]
    assert body()["status"]["engine"]["draft"]["hash"] == dh

    kube.apply({"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "tp", "namespace": "team-a"},
                "spec": {**NGRAM, "runtime": {**NGRAM["runtime"], "tensorParallelSize": 3}}})
    out = rec.reconcile(kube.get(c.API_VERSION, c.KIND, "team-a", "tp"))
    st = kube.get(c.API_VERSION, c.KIND, "team-a", "tp")["status"]
    deg = next(x for x in st["conditions"] if x["type"] == c.COND_DEGRADED)
    assert out.phase == c.PHASE_DEGRADED and deg["reason"] == "InvalidSpec" and "tensorParallelSize" in deg["message"]
    assert kube.get("apps/v1", "Deployment", "team-a", "tp") is None


EAGLE_HUB = {**EAGLE, "runtime": {"speculative": {"method": "eagle", "numTokens": 5, "draftModel": {
    "huggingFace": {"repo": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "revision": "a" * 40,
                    "secretRef": {"name": "hf", "key": "token"}}}}}}


def test_an_eagle_head_from_the_hub_is_fetched_by_kiln_head_fetch_onto_the_claim():
    """A Hub head is the build flow's second artefact: content-addressed by its source only, a
    shared Job running `kiln head fetch` (read by the real parser) into /engines/<key>, a
    record, then --speculative-model /engines/<key>."""
    cli = pytest.importorskip("kiln.runtime.cli")
    from kiln.common.enginespec import HeadSpec
    from kiln.operator.speculative import draft_build_spec

    obj, errors = admit(_ie(EAGLE_HUB))
    assert errors == []
    spec = parse_spec(obj["spec"])
    key = spec.draft_hash
    assert isinstance(spec.runtime.speculative.draft_engine, HeadSpec) and key != spec.engine_hash
    # the head's key names its source only: the target's build does not move it
    other = parse_spec({**EAGLE_HUB, "build": {"quantization": "int4-awq"}})
    assert other.draft_hash == key and other.engine_hash != spec.engine_hash
    moved = {**EAGLE_HUB, "runtime": {"speculative": {"method": "eagle", "draftModel": {
        "huggingFace": {"repo": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "revision": "b" * 40}}}}}
    assert parse_spec(moved).draft_hash != key
    job = b.build_job(draft_build_spec(spec), key, [OWNER])
    ctr = container(job)
    assert ctr["command"] == ["kiln", "head"]
    assert "nvidia.com/gpu" not in ctr["resources"].get("limits", {})  # a fetch needs no GPU
    ns = cli.build_parser().parse_args(ctr["command"][1:] + ctr["args"])
    assert (ns.command, ns.head_command) == ("head", "fetch")
    assert ns.source == "hf://yuhuili/EAGLE3-LLaMA3.1-Instruct-8B@" + "a" * 40 and ns.output == f"/engines/{key}"
    assert ns.download_dir == "/engines/.hf-cache" and ns.termination_log == c.TERMINATION_LOG
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in ctr["env"]
    # the plan: a Job for the head beside the target's; then the pods read the fetched head
    p = plan(spec, Observed(owner=OWNER, generation=1, claim_exists=True, record=_record(spec.engine_hash)), NOW)
    assert [j["metadata"]["name"] for j in p.apply if j["kind"] == "Job"] == [b.job_name(CLAIM, key)]
    p = plan(spec, Observed(owner=OWNER, generation=1, claim_exists=True, record=_record(spec.engine_hash),
                            draft_record=_record(key)), NOW)
    args = container(p.manifest("Deployment"))["args"]
    assert args[args.index("--speculative-model") + 1] == f"/engines/{key}"
    serve = cli.build_parser().parse_args(["serve"] + args)
    assert (serve.speculative_method, serve.num_speculative_tokens) == ("eagle", 5)
    with pytest.raises(EngineSpecError, match="read as it is"):
        parse_spec({**EAGLE_HUB, "runtime": {"speculative": {"method": "eagle", "draftModel": {
            **EAGLE_HUB["runtime"]["speculative"]["draftModel"], "quantization": "int4-awq"}}}})
