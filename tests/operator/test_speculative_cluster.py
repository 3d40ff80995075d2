"""runtime.speculative against the real API server (test plane; kwok completes the Jobs): the
CRD admits the examples and refuses what its rules refuse, the draft example gets two build
Jobs and two engine records, then a Deployment serving both engines, and the status subresource
keeps ``status.engine.draft`` (a field the CRD did not declare would be pruned)."""

from __future__ import annotations

import json
import subprocess

import pytest

from kiln.operator import builders as b
from kiln.operator.spec import parse_spec
from kiln.operator.speculative import LABEL_DRAFT_ENGINE_HASH

# the module-scoped plane, chart install and in-process operator of the operator's cluster tests
from test_operator_cluster import (admin, apply, get_ie, load, metrics, operator, plane, ready,  # noqa: F401
                                   release, wait_for)
from test_operator_cluster import ns  # noqa: F401

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def test_the_draft_example_builds_two_engines_then_serves_both(plane, admin, ns):  # noqa: F811
    obj = load("smollm2-speculative-draft.yaml")
    obj["spec"]["resources"]["gpus"] = 0  # the plane's kwok nodes have no GPUs
    apply(plane, ns, obj)
    spec = parse_spec(obj["spec"])
    h, dh = spec.engine_hash, spec.draft_hash
    ie = wait_for("Ready", lambda: ready(admin, ns, "smollm2-draft"), 120)
    assert ie["status"]["engineHash"] == h
    draft = ie["status"]["engine"]["draft"]
    assert draft["hash"] == dh and draft["state"] in ("Succeeded", "Cached")
    for hash_ in (h, dh):
        assert admin.get("v1", "ConfigMap", ns, b.record_name("kiln-engine-cache", hash_)) is not None
    job = admin.get("batch/v1", "Job", ns, b.job_name("kiln-engine-cache", dh))
    assert "int4-awq" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    dep = admin.get("apps/v1", "Deployment", ns, "smollm2-draft")
    assert dep["spec"]["template"]["metadata"]["labels"][LABEL_DRAFT_ENGINE_HASH] == dh
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--speculative-model") + 1] == f"/engines/{dh}"


def test_the_api_server_refuses_what_the_rules_refuse(plane, ns):  # noqa: F811
    for sp, message in (({"method": "draft"}, "draftModel is required for method draft and eagle"),
                        ({"method": "ngram", "draftModel": {"builtin": "smollm2-135m-instruct"}},
                         "method ngram uses no model"),
                        ({"method": "ngram", "numTokens": 17}, "numTokens"),
                        ({"method": "eagle", "draftModel": {"pvc": {"claimName": "h", "path": "x"},
                                                            "quantization": "int4-awq"}},
                         "an EAGLE head comes from pvc or huggingFace and is not quantized")):
        obj = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "bad"},
               "spec": {"model": {"builtin": "smollm2-135m-instruct"}, "runtime": {"speculative": sp}}}
        r = subprocess.run([plane.kubectl_bin, "--kubeconfig", plane.kubeconfig, "apply", "-n", ns, "-f", "-"],
                           input=json.dumps(obj), capture_output=True, text=True)
        assert r.returncode != 0 and message in r.stderr, (sp, r.stderr)
