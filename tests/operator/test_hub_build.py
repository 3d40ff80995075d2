"""``spec.model.huggingFace`` in the build Job (flags checked with the real ``kiln build``
parser) and a failed download's termination message as the Degraded reason."""

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


@pytest.mark.parametrize("repo, reason", [("kiln-test/missing", "ModelNotFound"),
                                          ("kiln-test/gated", "Unauthorized"),
                                          ("kiln-test/tiny@nope", "RevisionNotFound")])
def test_a_failed_download_is_the_degraded_reason(tmp_path, repo, reason):
    """The real ``kiln build`` writes the termination message; the operator's diagnosis maps it."""
    pytest.importorskip("kiln.runtime.build_cli")
    from kiln.devcluster.hubserver import HubServer

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    term = tmp_path / "termination-log"
    term.write_text("")
    with HubServer() as hub:
        hub.add("kiln-test/tiny", folder)
        hub.add("kiln-test/gated", folder, token="t")
        r = subprocess.run([sys.executable, "-m", "kiln.runtime.build_cli", "--model", f"hf://{repo}",
                            "--output", str(tmp_path / "e"), "--download-dir", str(tmp_path / "c"),
                            "--termination-log", str(term)],
                           env={"HF_ENDPOINT": hub.url, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 2, r.stderr
    cause = diagnose.failed_build_cause([_failed_pod(term.read_text())])
    assert diagnose.build_failure_reason(cause) == reason
    assert repo.split("@")[0] in cause


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
