"""``spec.model.huggingFace`` and ``spec.build.calibration.huggingFace`` in the build Job (flags
checked with the real ``kiln build`` parser), a failed download's termination message as the
Degraded reason, and a failing Hub resource beside a healthy one."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kiln.common.enginespec import BuildSpec, engine_hash
from kiln.operator import builders as b
from kiln.operator import diagnose

OWNER = {"name": "smollm2", "namespace": "team-a", "uid": "u-1"}
SHA = "0123456789abcdef0123456789abcdef01234567"
HF = {"repo": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": SHA, "secretRef": {"name": "hf", "key": "tok"},
      "endpoint": "http://hub-mirror.internal:8080"}
SPEC = {"model": {"huggingFace": HF}, "build": {"quantization": "fp8"}, "storage": {"claimName": "engines"}}


def _ctr(job):
    return job["spec"]["template"]["spec"]["containers"][0]


def test_build_job_downloads_the_pinned_commit_through_the_mirror_into_the_claims_cache():
    build = pytest.importorskip("kiln.runtime.build_cli")
    h = engine_hash(SPEC)
    ctr = _ctr(b.build_job(SPEC, h, OWNER))
    a = build.add_build_args(argparse.ArgumentParser()).parse_args(ctr["args"])
    assert a.model == f"hf://{HF['repo']}@{SHA}"
    assert a.download_dir == "/engines/.hf-cache"  # on the claim: a rebuild downloads nothing
    assert {"name": "engines", "mountPath": "/engines"} in ctr["volumeMounts"]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "tok"}}
    assert env["HF_ENDPOINT"]["value"] == HF["endpoint"]
    got = BuildSpec.from_cli(a.model, quantization=a.quantization, calibration_samples=a.calibration_samples,
                             max_seq_len=a.max_seq_len, max_batch_size=a.max_batch_size,
                             max_num_tokens=a.max_num_tokens)
    assert got.hash() == h and a.output == f"/engines/{h}"
    # the mirror does not change the content (the commit names it): the same engine
    assert engine_hash({**SPEC, "model": {"huggingFace": {k: v for k, v in HF.items() if k != "endpoint"}}}) == h
    assert engine_hash({**SPEC, "model": {"huggingFace": {**HF, "revision": "f" * 40}}}) != h


def test_a_model_without_the_hub_gets_no_download_cache():
    ctr = _ctr(b.build_job({"model": {"builtin": "smollm2-135m-instruct"}, "storage": {"claimName": "e"}}, "h" * 16,
                           OWNER))
    assert "--download-dir" not in ctr["args"] and "HF_ENDPOINT" not in {e["name"] for e in ctr["env"]}


def _failed_pod(message: str) -> dict:
    return {"metadata": {"name": "p"}, "status": {"containerStatuses": [{"name": "build", "state": {"terminated": {
        "exitCode": 2, "reason": "Error", "finishedAt": "2026-12-03T10:00:00Z", "message": message}}}]}}


@pytest.mark.parametrize("args, endpoint, reason, named", [
    (["--model", "hf://kiln-test/missing"], "hub", "ModelNotFound", "kiln-test/missing"),
    (["--model", "hf://kiln-test/gated"], "hub", "Unauthorized", "kiln-test/gated"),
    (["--model", "hf://kiln-test/tiny@nope"], "hub", "RevisionNotFound", "kiln-test/tiny"),
    (["--model", "hf://kiln-test/tiny"], "closed", "DownloadFailed", "kiln-test/tiny"),  # no connection
    (["--quantization", "fp8", "--calibration-data", "hf://datasets/kiln-test/calib/missing.jsonl"], "hub",
     "DatasetNotFound", "missing.jsonl"),
], ids=["missing", "gated", "revision", "closed-port", "calibration-file"])
def test_a_failed_download_is_the_degraded_reason(tmp_path, args, endpoint, reason, named):
    """The real ``kiln build`` writes the termination message; the operator's diagnosis maps it."""
    pytest.importorskip("kiln.runtime.build_cli")
    from kiln.devcluster.hubserver import HubServer
    from kiln.runtime.demo import free_port

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    term = tmp_path / "termination-log"
    term.write_text("")
    with HubServer() as hub:
        hub.add("kiln-test/tiny", folder)
        hub.add("kiln-test/gated", folder, token="t")
        hub.add_dataset("kiln-test/calib", folder)
        url = hub.url if endpoint == "hub" else f"http://127.0.0.1:{free_port()}"
        r = subprocess.run([sys.executable, "-m", "kiln.runtime.build_cli", *args,
                            "--output", str(tmp_path / "e"), "--download-dir", str(tmp_path / "c"),
                            "--termination-log", str(term)],
                           env={"HF_ENDPOINT": url, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 2, r.stderr
    cause = diagnose.failed_build_cause([_failed_pod(term.read_text())])
    assert diagnose.build_failure_reason(cause) == reason
    assert named in cause


def test_other_build_failures_stay_build_failed():
    assert diagnose.build_failure_reason("exit code 1 (Error): kiln build: out of disk") == "BuildFailed"
    assert diagnose.build_failure_reason("") == "BuildFailed"


def test_plan_degrades_with_the_download_reason():
    from kiln.operator.plan import Observed, plan
    from kiln.operator.spec import parse_spec

    spec = parse_spec(SPEC)
    h, claim = spec.engine_hash, spec.storage.claim_name
    failed = {"metadata": {"name": b.job_name(claim, h), "labels": b.build_labels(claim, h)},
              "status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True",
                                                       "reason": "BackoffLimitExceeded"}]}}
    msg = "kiln build: Unauthorized: access to HuggingFaceTB/SmolLM2-135M-Instruct on http://m denied: the token was refused"
    p = plan(spec, Observed(owner=OWNER, claim_exists=True, jobs=(failed,), build_pods=(_failed_pod(msg),)),
             "2026-12-03T10:00:05Z")
    deg = next(x for x in p.status["conditions"] if x["type"] == "Degraded")
    assert p.phase == "Degraded" and deg["status"] == "True" and deg["reason"] == "Unauthorized"
    assert "the token was refused" in deg["message"]


@pytest.mark.parametrize("model", [
    {"builtin": "smollm2-135m-instruct"},
    {"pvc": {"claimName": "models", "path": "llama/./m.gguf"}},
    {"pvc": {"claimName": "models"}},
    {"path": "/data/models/llama"},
], ids=["builtin", "pvc", "pvc-root", "path"])  # the Hub's: the test above (--print-hash resolves the revision)
@pytest.mark.parametrize("quant", ["none", "int4-awq"])
def test_build_job_args_hash_to_the_operators_engine(model, quant, capsys):
    """``kiln build --print-hash`` on the Job's own arguments (the real parser and spec code)
    names the engine folder the operator waits for, for every model source kind."""
    build = pytest.importorskip("kiln.runtime.build_cli")
    spec = {"model": model, "build": {"quantization": quant}, "storage": {"claimName": "engines"}}
    h = engine_hash(spec)
    args = _ctr(b.build_job(spec, h, OWNER))["args"]
    parser = build.add_build_args(argparse.ArgumentParser())
    assert build.run_build(parser.parse_args([*args, "--print-hash"])) == 0
    assert capsys.readouterr().out.strip() == h
    if "pvc" in model:
        assert parser.parse_args(args).models_mount == "/models"


def test_a_claim_path_that_leaves_the_claim_is_refused():
    from kiln.common.enginespec import EngineSpecError

    with pytest.raises(EngineSpecError, match="leaves the claim"):
        engine_hash({"model": {"pvc": {"claimName": "m", "path": "../etc"}}})
    with pytest.raises(EngineSpecError, match="leaves the claim"):
        BuildSpec.from_cli("pvc://m/a/../../x")


DATA_SHA = "89abcdef0123456789abcdef0123456789abcdef"
CAL = {"huggingFace": {"repo": "kiln-test/calib", "revision": DATA_SHA, "path": "data/cal.jsonl",
                       "secretRef": {"name": "hf-data"}, "endpoint": "http://hub-mirror.internal:8080"}}


def test_build_job_downloads_the_calibration_dataset_file_and_hashes_as_kiln_build(tmp_path, monkeypatch, capsys):
    """``build.calibration.huggingFace``: the Job's flags (the real parser) name the dataset's
    file at the pinned commit, the dataset's token and mirror are the Job's HF_TOKEN and
    HF_ENDPOINT, and ``kiln build --print-hash`` on those flags, resolving the commit on a Hub
    server, gives the operator's engine hash."""
    build = pytest.importorskip("kiln.runtime.build_cli")
    from kiln.devcluster.hubserver import HubServer

    spec = {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "fp8", "calibration": CAL},
            "storage": {"claimName": "engines"}}
    h = engine_hash(spec)
    ctr = _ctr(b.build_job(spec, h, OWNER))
    parser = build.add_build_args(argparse.ArgumentParser())
    a = parser.parse_args(ctr["args"])
    assert a.calibration_data == f"hf://datasets/kiln-test/calib@{DATA_SHA}/data/cal.jsonl"
    assert a.calibration_checksum is None and a.download_dir == "/engines/.hf-cache"
    env = {e["name"]: e for e in ctr["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-data", "key": "token"}}
    assert env["HF_ENDPOINT"]["value"] == CAL["huggingFace"]["endpoint"]
    folder = tmp_path / "ds"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "cal.jsonl").write_text('{"text": "calibration text"}\n')
    for k in [k for k in __import__("os").environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    with HubServer() as hub:
        hub.add_dataset("kiln-test/calib", folder, sha=DATA_SHA)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        args = [x if x != a.download_dir else str(tmp_path / "cache") for x in ctr["args"]]
        assert build.run_build(parser.parse_args([*args, "--print-hash", "--termination-log", ""])) == 0
        assert capsys.readouterr().out.strip() == h
        assert hub.total_gets() == 0  # the hash needs the commit, not the file
    # what is hashed: repo, revision, path and a given checksum; not the token or the mirror
    hf = CAL["huggingFace"]

    def with_cal(**kw):
        cal = {"huggingFace": {**hf, **{k: v for k, v in kw.items() if k != "checksum"}}}
        if "checksum" in kw:
            cal["checksum"] = kw["checksum"]
        return engine_hash({**spec, "build": {"quantization": "fp8", "calibration": cal}})

    assert with_cal(secretRef={"name": "other"}, endpoint="http://m:1") == h
    for kw in ({"revision": "f" * 40}, {"path": "data/other.jsonl"}, {"repo": "kiln-test/calib2"},
               {"checksum": "sha256:" + "ab" * 32}):
        assert with_cal(**kw) != h, kw
    assert engine_hash({**spec, "build": {"quantization": "fp8"}}) != h  # the shipped mixture
    # a build that does not calibrate neither hashes nor downloads it
    none = {**spec, "build": {"quantization": "none", "calibration": CAL}}
    assert "--calibration-data" not in _ctr(b.build_job(none, engine_hash(none), OWNER))["args"]
    assert engine_hash(none) == engine_hash({**none, "build": {"quantization": "none"}})


def test_a_hub_model_and_a_calibration_dataset_share_the_jobs_token_and_mirror():
    from kiln.common.enginespec import EngineSpecError
    from kiln.operator.spec import parse_spec

    cal = {"huggingFace": {"repo": "kiln-test/calib", "revision": DATA_SHA, "path": "c.jsonl"}}
    model_hub = {**SPEC, "build": {"quantization": "fp8", "calibration": cal}}
    env = {e["name"]: e for e in _ctr(b.build_job(model_hub, engine_hash(model_hub), OWNER))["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == HF["secretRef"]  # the model's
    assert env["HF_ENDPOINT"]["value"] == HF["endpoint"]
    same = {"huggingFace": {**cal["huggingFace"], "secretRef": HF["secretRef"], "endpoint": HF["endpoint"]}}
    parse_spec({**SPEC, "build": {"quantization": "fp8", "calibration": same}})
    for field, value in (("secretRef", {"name": "other"}), ("endpoint", "http://elsewhere:1")):
        other = {"huggingFace": {**cal["huggingFace"], field: value}}
        with pytest.raises(EngineSpecError, match=f"build.calibration.huggingFace.{field}: differs"):
            parse_spec({**SPEC, "build": {"quantization": "fp8", "calibration": other}})
    for bad, msg in (({"huggingFace": {"repo": "kiln-test/calib"}}, "repo and path are required"),
                     ({"huggingFace": {"repo": "calib", "path": "c"}}, "expected org/name"),
                     ({"huggingFace": {"repo": "a/b", "path": "../c"}}, "not a file path inside the dataset"),
                     ({**cal, "pvc": {"claimName": "d", "path": "c"}, "checksum": "sha256:" + "0" * 64},
                      "exactly one source")):
        with pytest.raises(EngineSpecError, match=msg):
            engine_hash({"model": {"builtin": "smollm2-135m-instruct"},
                         "build": {"quantization": "fp8", "calibration": bad}})


def test_a_failing_hub_resource_does_not_hold_back_a_healthy_one():
    """Two InferenceEngines in one namespace, reconciled in turn: the Hub model whose build
    failed (unknown repo) is Degraded with the download's reason and gets no new Job and no
    Deployment; the builtin one beside it builds, deploys and becomes Ready."""
    from fakekube import FakeKube

    from kiln.operator import constants as c
    from kiln.operator.reconcile import Reconciler

    ns = OWNER["namespace"]
    kube = FakeKube()
    rec = Reconciler(kube)
    broken = {"model": {"huggingFace": {"repo": "kiln-test/missing", "revision": SHA}}}
    healthy = {"model": {"builtin": "smollm2-135m-instruct"}}

    def body(name):
        return kube.get(c.API_VERSION, c.KIND, ns, name)

    for name, spec in (("broken", broken), ("healthy", healthy)):
        kube.apply({"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": ns},
                    "spec": spec})
        rec.reconcile(body(name))
    claim = "kiln-engine-cache"
    hb, hh = engine_hash(broken), engine_hash(healthy)
    job = b.job_name(claim, hb)
    kube.set_status("batch/v1", "Job", ns, job, {"failed": 1, "conditions": [
        {"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]})
    msg = "kiln build: ModelNotFound: model kiln-test/missing not found on https://huggingface.co"
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": job + "-x", "namespace": ns,
                "labels": b.build_labels(claim, hb)}})
    kube.set_status("v1", "Pod", ns, job + "-x", _failed_pod(msg)["status"])
    kube.set_status("batch/v1", "Job", ns, b.job_name(claim, hh), {
        "succeeded": 1, "completionTime": "2026-12-03T10:00:00Z",
        "conditions": [{"type": "Complete", "status": "True"}]})
    for _ in range(2):  # each resource in turn, twice: the failure stays put and holds nothing back
        out_b = rec.reconcile(body("broken"))
        out_h = rec.reconcile(body("healthy"))
        kube.set_status("apps/v1", "Deployment", ns, "healthy",
                        {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1})
    assert out_b.phase == c.PHASE_DEGRADED
    deg = next(x for x in body("broken")["status"]["conditions"] if x["type"] == "Degraded")
    assert deg["reason"] == "ModelNotFound" and "kiln-test/missing" in deg["message"]
    assert kube.get("apps/v1", "Deployment", ns, "broken") is None
    assert [j["metadata"]["name"] for j in kube.list("batch/v1", "Job", ns)].count(job) == 1  # no retry storm
    assert out_h.built and out_h.serving_hash == hh
    assert body("healthy")["status"]["phase"] == c.PHASE_READY
