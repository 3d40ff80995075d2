"""The typed InferenceEngine spec: parsed once, the CRD's defaults filled, clear errors."""

import pathlib
import re

import pytest
import yaml

from kiln.common.enginespec import BUILD_DEFAULTS, EngineSpecError, engine_hash
from kiln.operator.spec import InferenceEngineSpec, as_spec, parse_spec, source_text

MINIMAL = {"model": {"builtin": "smollm2-135m-instruct"}}
CRD = pathlib.Path(__file__).resolve().parents[2] / "crds" / "inferenceengine.yaml"


def crd_defaults():
    """``{field path: default}`` of every non-object field of the CRD's spec with a default."""
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    out = {}

    def walk(node, path):
        for key, sub in (node.get("properties") or {}).items():
            if "default" in sub and sub.get("type") != "object":
                out[path + (key,)] = sub["default"]
            walk(sub, path + (key,))

    walk(schema, ())
    return out


def snake(name):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_defaults_are_the_crds():
    """Every default the API server fills is the typed spec's default too, so a spec read
    from the cluster and a plain dict without the defaults plan the same children."""
    parsed = parse_spec(MINIMAL)
    with_secret = parse_spec({"model": {"huggingFace": {"repo": "org/name", "secretRef": {"name": "hf"}}}})
    with_pool = parse_spec({**MINIMAL, "gateway": {"inferencePool": {"enabled": True}}})
    checked = 0
    for path, default in crd_defaults().items():
        if path[0] == "build" and path[1] in BUILD_DEFAULTS:
            continue  # the engine spec's (tests/operator/test_crd.py)
        if path == ("model", "huggingFace", "secretRef", "key"):
            got = with_secret.model.hf_token.key
        elif path == ("runtime", "speculative", "draftModel", "huggingFace", "secretRef", "key"):
            got = parse_spec({**MINIMAL, "runtime": {"speculative": {"method": "draft", "draftModel": {
                "huggingFace": {"repo": "org/small", "secretRef": {"name": "hf"}}}}}}
                             ).runtime.speculative.draft_model.hf_token.key
        elif path == ("build", "calibration", "huggingFace", "secretRef", "key"):
            got = parse_spec({**MINIMAL, "build": {"calibration": {"huggingFace": {
                "repo": "org/calib", "path": "c.jsonl", "secretRef": {"name": "hf"}}}}}).build.calibration_hf_token.key
        elif path[0] == "resources" and path[1] in ("requests", "limits"):
            got = getattr(parsed.resources.compute, path[1])
        elif path[:2] == ("autoscaling", "keda"):
            got = getattr(parsed.autoscaling.keda, snake(path[2]))
        elif path[0] == "gateway":  # defaults inside an asked-for section
            if path[-1] == "enabled":
                continue  # presence: httpRoute is on when given, inferencePool when enabled
            got = getattr(with_pool.gateway.inference_pool.endpoint_picker, snake(path[-1]))
        elif len(path) == 1:
            got = getattr(parsed, snake(path[0]))
        else:
            got = getattr(getattr(parsed, path[0]), snake(path[1]))
        if isinstance(got, tuple):
            got = list(got)
        assert got == default, path
        checked += 1
    assert checked >= 20


def test_a_cluster_spec_and_a_plain_dict_are_the_same_spec():
    filled = {"model": {"builtin": "smollm2-135m-instruct"}, "replicas": 1, "suspend": False,
              "imagePullPolicy": "IfNotPresent",
              "runtime": {"blockSize": 16, "kvCacheMemoryFraction": 0.85, "schedulerPolicy": "max_utilization",
                          "tensorParallelSize": 1, "compileCache": True},
              "resources": {"gpus": 1, "gpuResourceName": "nvidia.com/gpu"},
              "autoscaling": {"mode": "off", "minReplicas": 1, "maxReplicas": 4, "targetQueueTimeSeconds": 0.5,
                              "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300},
              "storage": {"claimName": "kiln-engine-cache", "create": True, "size": "50Gi",
                          "accessModes": ["ReadWriteOnce"]},
              "rollout": {"maxSurge": 1, "maxUnavailable": 0, "startupTimeoutSeconds": 1800},
              "build": {**BUILD_DEFAULTS, "backoffLimit": 1, "activeDeadlineSeconds": 7200}}
    assert parse_spec(filled) == parse_spec(MINIMAL)


def test_fields_are_typed_and_the_hash_is_the_engine_specs():
    s = parse_spec({"model": {"pvc": {"claimName": "models", "path": "llama/model.gguf"}, "servedModelName": "llama"},
                    "build": {"quantization": "fp8", "backoffLimit": 3},
                    "runtime": {"maxNumSeqs": 32, "extraArgs": ["--seed", 1], "env": [{"name": "A", "value": "b"}]},
                    "resources": {"gpus": 0, "requests": {"memory": "16Gi", "cpu": 2}},
                    "autoscaling": {"mode": "builtin", "minReplicas": 5}, "image": "mine:1", "suspend": True})
    assert isinstance(s, InferenceEngineSpec)
    assert s.engine_hash == engine_hash({"model": {"pvc": {"claimName": "models", "path": "llama/model.gguf"}},
                                         "build": {"quantization": "fp8"}})
    assert (s.model.pvc_claim, s.model.pvc_path, s.model.served_model_name) == ("models", "llama/model.gguf", "llama")
    assert s.model.text == "pvc://models/llama/model.gguf"
    assert s.build.backoff_limit == 3 and s.engine.quantization == "fp8"
    assert s.runtime.max_num_seqs == 32 and s.runtime.extra_args == ("--seed", "1")
    assert s.runtime.env[0].name == "A" and s.runtime.env[0].value == "b"
    assert s.resources.gpus == 0 and s.resources.compute.requests == {"memory": "16Gi", "cpu": "2"}
    assert s.autoscaling.max_replicas == 5  # max(4, minReplicas) when left out
    assert s.image == "mine:1" and s.suspend


@pytest.mark.parametrize("raw, words", [
    ({"model": {}}, "model: exactly one source"),
    ({**MINIMAL, "replicas": "two"}, "replicas: expected an integer"),
    ({**MINIMAL, "suspend": "yes"}, "suspend: expected true or false"),
    ({**MINIMAL, "runtime": []}, "runtime: expected an object"),
    ({**MINIMAL, "autoscaling": {"mode": "sometimes"}}, "autoscaling.mode"),
    ({**MINIMAL, "runtime": {"env": [{"value": "x"}]}}, "runtime.env[0]"),
    ({**MINIMAL, "runtime": {"maxModelLen": 8192}}, "runtime.maxModelLen 8192 is larger than build.maxSeqLen 4096"),
])
def test_errors_name_the_field(raw, words):
    with pytest.raises(EngineSpecError, match=re.escape(words)):
        parse_spec(raw)


def test_source_text_names_even_an_unparsable_source():
    assert source_text({"huggingFace": {"repo": "org/name", "revision": "abc"}}) == "hf://org/name@abc"
    assert source_text({"builtin": "smollm2-135m-instruct", "pvc": {"claimName": "x"}}) == "builtin:smollm2-135m-instruct"
    assert source_text(None) == "" and source_text("nonsense") == ""


def test_as_spec_parses_plain_dicts_once():
    s = parse_spec(MINIMAL)
    assert as_spec(s) is s and as_spec(MINIMAL) == s
