"""The InferenceEngine CRD: structure, descriptions, defaults, CEL rules, examples."""

from pathlib import Path

import pytest
import yaml

from kiln.common.enginespec import BUILD_DEFAULTS, QUANTIZATION_METHODS, engine_hash

from crdcheck import ROOT, admit, load_crd, version_schema

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


def walk(s, path="spec"):
    yield path, s
    for name, sub in (s.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(s.get("items"), dict):
        yield from walk(s["items"], f"{path}[]")
    if isinstance(s.get("additionalProperties"), dict):
        yield from walk(s["additionalProperties"], f"{path}{{}}")


def test_identity_subresources_and_columns():
    crd = load_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "inferenceengines.kiln.dev"
    assert (spec["group"], spec["names"]["kind"], spec["names"]["shortNames"]) == ("kiln.dev", "InferenceEngine", ["ie"])
    v = spec["versions"][0]
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                                          "labelSelectorPath": ".status.selector"}
    cols = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"]}
    assert {"Phase", "Model", "Quantization", "Ready", "Age"} <= set(cols)


def test_every_field_has_a_description_and_a_type():
    for path, s in walk(version_schema()):
        if path == "spec.metadata":
            continue  # the API server forbids anything but type on metadata
        assert s.get("description"), f"{path} has no description"
        assert s.get("type") or s.get("x-kubernetes-int-or-string"), f"{path} has no type"


def test_build_defaults_match_enginespec():
    build = version_schema()["properties"]["spec"]["properties"]["build"]["properties"]
    for key, value in BUILD_DEFAULTS.items():
        assert build[key]["default"] == value, key
    assert build["quantization"]["enum"] == list(QUANTIZATION_METHODS)


def test_conditions_are_a_map_list_for_server_side_apply():
    conds = version_schema()["properties"]["status"]["properties"]["conditions"]
    assert conds["x-kubernetes-list-type"] == "map" and conds["x-kubernetes-list-map-keys"] == ["type"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path):
    obj, errors = admit(yaml.safe_load(path.read_text()))
    assert errors == []
    engine_hash(obj["spec"])  # and the operator can hash them


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_fail_with_their_documented_message(path):
    text = path.read_text()
    expected = text.split('Rejected by the API server: "', 1)[1].split('"', 1)[0]
    _, errors = admit(yaml.safe_load(text))
    assert expected in errors


def test_omitted_and_written_defaults_hash_alike_after_defaulting():
    small, _ = admit({"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"},
                      "spec": {"model": {"builtin": "smollm2-135m-instruct"}}})
    assert small["spec"]["build"]["groupSize"] == 128 and small["spec"]["autoscaling"]["mode"] == "off"
    assert engine_hash(small["spec"]) == engine_hash({"model": {"builtin": "smollm2-135m-instruct"}})


@pytest.mark.parametrize("spec, message", [
    ({"model": {"builtin": "smollm2-135m-instruct"}, "rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "cannot both be 0"),
    ({"model": {"builtin": "smollm2-135m-instruct"}, "build": {"groupSize": 256}}, "groupSize must be one of"),
    ({"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "fp8", "quantizeLmHead": True}},
     "quantizeLmHead applies only to quantization int4-awq and int4-gptq"),
    ({"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantizeLmHead": True}},
     "quantizeLmHead applies only to"),
    ({"model": {"builtin": "smollm2-135m-instruct", "pvc": {"claimName": "m", "path": "x"}}}, "exactly one source"),
])
def test_cel_rules(spec, message):
    _, errors = admit({"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"}, "spec": spec})
    assert any(message in e for e in errors), errors


def test_build_calibration_needs_a_claim_file_and_its_checksum():
    base = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"}}
    ok = {"pvc": {"claimName": "data", "path": "cal.jsonl"}, "checksum": "sha256:" + "ab" * 32}
    obj, errors = admit({**base, "spec": {"model": {"builtin": "smollm2-135m-instruct"},
                                          "build": {"quantization": "fp8", "calibration": ok}}})
    assert errors == [] and obj["spec"]["build"]["calibration"] == ok
    for bad in ({"pvc": ok["pvc"]}, {"checksum": ok["checksum"]}, {**ok, "checksum": "md5:00"},
                {**ok, "pvc": {"claimName": "data"}}):
        _, errors = admit({**base, "spec": {"model": {"builtin": "smollm2-135m-instruct"},
                                            "build": {"quantization": "fp8", "calibration": bad}}})
        assert errors, bad


def test_build_calibration_from_a_hub_dataset_file():
    base = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"}}
    hf = {"repo": "org/calib", "revision": "0" * 40, "path": "data/cal.jsonl", "secretRef": {"name": "hf"},
          "endpoint": "http://mirror:8080"}

    def admit_cal(cal):
        return admit({**base, "spec": {"model": {"builtin": "smollm2-135m-instruct"},
                                       "build": {"quantization": "fp8", "calibration": cal}}})

    for ok in ({"huggingFace": hf}, {"huggingFace": {"repo": "org/calib", "path": "c.txt"}},
               {"huggingFace": hf, "checksum": "sha256:" + "ab" * 32}):
        obj, errors = admit_cal(ok)
        assert errors == [], (ok, errors)
        engine_hash(obj["spec"])  # what the API server admits, the operator parses
    assert obj["spec"]["build"]["calibration"]["huggingFace"]["secretRef"] == {"name": "hf", "key": "token"}
    pvc = {"claimName": "data", "path": "cal.jsonl"}
    for bad, msg in (({"huggingFace": {"repo": "org/calib"}}, "path"),
                     ({"huggingFace": {**hf, "repo": "calib"}}, "repo"),
                     ({"huggingFace": hf, "pvc": pvc, "checksum": "sha256:" + "ab" * 32}, "exactly one source"),
                     ({"checksum": "sha256:" + "ab" * 32}, "exactly one source"),
                     ({"pvc": pvc}, "checksum is required with pvc")):
        _, errors = admit_cal(bad)
        assert any(msg in e for e in errors), (bad, errors)


def test_unknown_enum_is_rejected():
    _, errors = admit({"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"},
                       "spec": {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "int3"}}})
    assert errors and "quantization" in errors[0]


def test_quantize_lm_head_is_admitted_with_int4():
    for q in ("int4-awq", "int4-gptq"):
        obj, errors = admit({"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"},
                             "spec": {"model": {"builtin": "smollm2-135m-instruct"},
                                      "build": {"quantization": q, "groupSize": 32, "quantizeLmHead": True}}})
        assert errors == [] and obj["spec"]["build"]["quantizeLmHead"] is True
    obj, errors = admit({"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"},
                         "spec": {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "fp8"}}})
    assert errors == [] and obj["spec"]["build"]["quantizeLmHead"] is False  # the default


def _described_default(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def test_every_default_is_in_its_description():
    """`kubectl explain` prints descriptions, not `default:`: each default is written there."""
    checked = 0
    for path, s in walk(version_schema()):
        if "default" in s and s["default"] != {}:
            assert f"Default: {_described_default(s['default'])}." in s["description"], path
            checked += 1
    assert checked >= 30


def _ie(spec):
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"},
            "spec": {"model": {"builtin": "smollm2-135m-instruct"}, **spec}}


def test_smoothquant_alpha_is_a_number_and_hashes_as_before():
    from kiln.common.enginespec import BuildSpec

    defaulted, errors = admit(_ie({"build": {"quantization": "int8-smoothquant"}}))
    assert errors == [] and defaulted["spec"]["build"]["smoothquantAlpha"] == 0.5
    for bad in ("0.5", "500m", 1.5, -0.1):
        _, errors = admit(_ie({"build": {"quantization": "int8-smoothquant", "smoothquantAlpha": bad}}))
        assert errors and "smoothquantAlpha" in errors[0], bad
    written, errors = admit(_ie({"build": {"quantization": "int8-smoothquant", "smoothquantAlpha": 0.50}}))
    assert errors == []
    # The hashed form stays the canonical decimal string, so engines built when the field was a
    # quantity string ("0.5", "500m") keep their hash, and `kiln build --smoothquant-alpha 0.5` agrees.
    h = engine_hash(defaulted["spec"])
    assert engine_hash(written["spec"]) == h
    for old in ("0.5", "500m", "0.50"):
        assert engine_hash({**defaulted["spec"], "build": {**defaulted["spec"]["build"], "smoothquantAlpha": old}}) == h
    cli = BuildSpec.from_cli("builtin:smollm2-135m-instruct", quantization="int8-smoothquant", smoothquant_alpha="0.5")
    assert cli.hash() == h and cli.to_dict()["quantization"]["alpha"] == "0.5"
    other, _ = admit(_ie({"build": {"quantization": "int8-smoothquant", "smoothquantAlpha": 0.75}}))
    assert engine_hash(other["spec"]) != h


def test_max_replicas_defaults_to_at_least_min_replicas():
    """No CRD default for maxReplicas: a fixed 4 would refuse `minReplicas: 6` alone."""
    from kiln.operator.spec import parse_spec

    obj, errors = admit(_ie({"autoscaling": {"mode": "builtin", "minReplicas": 6}}))
    assert errors == [] and "maxReplicas" not in obj["spec"]["autoscaling"]
    assert parse_spec(obj["spec"]).autoscaling.max_replicas == 6
    obj, _ = admit(_ie({"autoscaling": {"mode": "builtin"}}))
    assert parse_spec(obj["spec"]).autoscaling.max_replicas == 4


def test_pod_overrides_are_validated_by_the_crd():
    from test_builders import POD

    base = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "a"}}
    ok = {"model": {"builtin": "smollm2-135m-instruct"}, "pod": POD,
          "runtime": {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                      "envFrom": [{"configMapRef": {"name": "c"}}]}}
    assert admit({**base, "spec": ok})[1] == []
    for pod, runtime, message in [
        ({"labels": {"kiln.dev/engine-hash": "x"}}, {}, "are set by Kiln"),
        ({"labels": {"bad key": "x"}}, {}, "every key must be a label key"),
        ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "k"}]}, {}, "whenUnsatisfiable"),
        ({"topologySpreadConstraints": [{"maxSkew": 0, "topologyKey": "k", "whenUnsatisfiable": "ScheduleAnyway"}]},
         {}, "maxSkew"),
        ({"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}}},
         {}, "topologyKey"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "a", "operator": "Near"}]}]}}}}, {}, "Near"),
        ({"runtimeClassName": "Not_A_Name"}, {}, "runtimeClassName"),
        ({"imagePullSecrets": [{"name": ""}]}, {}, "imagePullSecrets"),
        ({}, {"env": [{"name": "T", "value": "v", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}, "not both"),
        ({}, {"env": [{"name": "T", "valueFrom": {}}]}, "valueFrom"),
        ({}, {"envFrom": [{"configMapRef": {"name": "c"}, "secretRef": {"name": "s"}}]}, "exactly one of configMapRef"),
    ]:
        errors = admit({**base, "spec": {**ok, "pod": pod, "runtime": runtime}})[1]
        assert any(message in e for e in errors), (pod, runtime, errors)
