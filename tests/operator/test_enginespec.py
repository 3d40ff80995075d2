"""kiln.common.enginespec: normalization and the engine hash (torch-free)."""

import json
import subprocess
import sys

import pytest

from kiln.common import constants, manifest
from kiln.common import enginespec as es

SMOL = {"builtin": "smollm2-135m-instruct"}


def h(build=None, model=SMOL):
    return es.engine_hash({"model": model, "build": build or {}})


def test_hash_is_hex_of_fixed_length_and_deterministic():
    a = h({"quantization": "int4-awq"})
    assert a == h({"quantization": "int4-awq"})
    assert len(a) == constants.HASH_LENGTH and int(a, 16) >= 0


@pytest.mark.parametrize("build", [
    {},  # every default omitted
    dict(es.BUILD_DEFAULTS),  # every default written out
    {"maxSeqLen": "4096", "calibrationSamples": 128.0},  # numeric spellings
    {"quantization": "NONE", "kvCacheDtype": "AUTO"},  # case
    {"groupSize": 64, "smoothquantAlpha": "0.9", "quantizeLmHead": True},  # knobs that method "none" ignores
    {"quantization": None, "groupSize": None},  # null = default
])
def test_equivalent_spellings_of_the_default_give_one_hash(build):
    assert h(build) == h({})


def test_quantity_spellings_and_key_order():
    base = h({"quantization": "int8-smoothquant", "smoothquantAlpha": "0.5"})
    assert h({"smoothquantAlpha": "500m", "quantization": "int8-smoothquant"}) == base
    assert h({"quantization": "int8_smoothquant", "smoothquantAlpha": 0.5}) == base
    assert h({"quantization": "int8-smoothquant", "smoothquantAlpha": "0.50"}) == base
    assert h({"quantization": "int8-smoothquant"}) == base  # default alpha
    assert h({"quantization": "int8-smoothquant", "smoothquantAlpha": "0.6"}) != base


def test_settings_a_method_ignores_do_not_change_its_hash():
    assert h({"quantization": "fp8", "groupSize": 32}) == h({"quantization": "fp8"})
    assert h({"quantization": "none", "calibrationSamples": 7}) == h({"quantization": "none"})
    # fp8 calibrates (GPTQ-compensated weights + smoothing), so its sample count is part of it
    assert h({"quantization": "fp8", "calibrationSamples": 7}) != h({"quantization": "fp8"})
    assert h({"quantization": "int4-awq", "groupSize": 64}) != h({"quantization": "int4-awq"})
    assert h({"quantization": "int4-awq", "calibrationSamples": 7}) != h({"quantization": "int4-awq"})
    assert h({"kvCacheDtype": "fp8", "calibrationSamples": 7}) != h({"kvCacheDtype": "fp8"})
    assert h({"quantization": "fp8", "quantizeLmHead": True}) == h({"quantization": "fp8"})
    assert h({"quantization": "int4-awq", "quantizeLmHead": False}) == h({"quantization": "int4-awq"})
    assert h({"quantization": "int4-gptq", "quantizeLmHead": True}) != h({"quantization": "int4-gptq"})


def test_every_hashed_field_changes_the_hash():
    seen = {h({})}
    for build in [{"quantization": "fp8"}, {"quantization": "int4-awq"}, {"quantization": "int4-gptq"},
                  {"quantization": "int8-smoothquant"}, {"kvCacheDtype": "fp8"}, {"maxSeqLen": 2048},
                  {"quantization": "int4-awq", "quantizeLmHead": True},
                  {"maxBatchSize": 8}, {"maxNumTokens": 4096}]:
        seen.add(h(build))
    seen.add(h(model={"pvc": {"claimName": "models", "path": "llama"}}))
    seen.add(h(model={"huggingFace": {"repo": "org/m", "revision": "abc"}}))
    seen.add(h(model={"huggingFace": {"repo": "org/m", "revision": "def"}}))
    seen.add(h(model={"builtin": "smollm2-135m-instruct", "checksum": "sha256:" + "0" * 64}))
    assert len(seen) == 14


def test_fields_outside_the_build_do_not_change_the_hash():
    spec = {"model": SMOL, "build": {"quantization": "fp8", "backoffLimit": 3, "activeDeadlineSeconds": 60,
                                     "resources": {"requests": {"cpu": "2"}}},
            "runtime": {"maxNumSeqs": 3}, "replicas": 5, "suspend": True}
    assert es.engine_hash(spec) == h({"quantization": "fp8"})


def test_format_version_is_hashed():
    d = es.normalize_build_spec({"model": SMOL})
    assert d["format_version"] == constants.ENGINE_FORMAT_VERSION
    bs = es.BuildSpec.from_dict({"model": SMOL})
    other = es.BuildSpec(source=bs.source, format_version=constants.ENGINE_FORMAT_VERSION + 1)
    assert other.hash() != bs.hash()


def test_normalized_form_is_canonical_json_without_floats():
    d = es.normalize_build_spec({"model": SMOL, "build": {"quantization": "int8-smoothquant", "smoothquantAlpha": 0.25}})
    text = es.canonical_json(d)
    assert json.loads(text) == d and " " not in text
    assert d["quantization"] == {"method": "int8-smoothquant", "alpha": "0.25", "calibration_samples": 128}
    with pytest.raises(es.EngineSpecError):
        es.canonical_json({"x": 0.5})


@pytest.mark.parametrize("spec, word", [
    ({"model": SMOL, "build": {"quantization": "int3"}}, "unknown method"),
    ({"model": SMOL, "build": {"quantization": "int4-awq", "groupSize": 48}}, "groupSize"),
    ({"model": {}, "build": {}}, "exactly one source"),
    ({"model": {"builtin": "x", "pvc": {"claimName": "c", "path": "p"}}}, "exactly one source"),
    ({"model": SMOL, "build": {"smoothquantAlpha": "lots"}}, "smoothquantAlpha"),
    ({"model": SMOL, "build": {"smoothquantAlpha": "1.5"}}, "[0, 1]"),
    ({"model": SMOL, "build": {"maxSeqLen": 0}}, "maxSeqLen"),
    ({"model": SMOL, "build": {"maxSeqLen": 8}}, "maxSeqLen: 8 is below the minimum 16"),
    ({"model": SMOL, "build": {"maxBatchSize": 100000000}}, "maxBatchSize: 100000000 is above the maximum 4096"),
    ({"model": SMOL, "build": {"maxNumTokens": 10**12}}, "maxNumTokens: 1000000000000 is above the maximum"),
    ({"model": SMOL, "build": {"calibrationSamples": 100001}}, "calibrationSamples"),
    ({"model": SMOL, "build": {"kvCacheDtype": "int8"}}, "kvCacheDtype"),
    ({"model": SMOL, "build": {"quantization": "int4-awq", "quantizeLmHead": "yes"}}, "quantizeLmHead"),
    ({"model": {"pvc": {"path": "x"}}}, "claimName"),
    ({"model": SMOL, "build": {"calibration": {"pvc": {"claimName": "d", "path": "c.txt"}}}}, "calibration.checksum: required"),
    ({"model": SMOL, "build": {"calibration": {"pvc": {"claimName": "d", "path": "c.txt"}, "checksum": "sha256:12"}}},
     "calibration.checksum: expected sha256"),
    ({"model": SMOL, "build": {"calibration": {"pvc": {"claimName": "d"}, "checksum": "sha256:" + "0" * 64}}},
     "calibration.pvc: claimName and path"),
    ({"model": SMOL, "build": {"calibration": {"pvc": {"claimName": "d", "path": "../x"}, "checksum": "sha256:" + "0" * 64}}},
     "not a file path inside the claim"),
    ({"model": SMOL, "build": {"calibration": {"url": "x"}}}, "unknown field"),
])
def test_invalid_specs_raise_a_clear_error(spec, word):
    with pytest.raises(es.EngineSpecError, match=word.replace("[", r"\[").replace("]", r"\]")):
        es.engine_hash(spec)


def test_calibration_data_is_hashed_by_its_bytes_when_the_build_calibrates():
    ref = {"pvc": {"claimName": "d", "path": "a/c.jsonl"}, "checksum": "sha256:" + "1" * 64}
    fp8 = {"model": SMOL, "build": {"quantization": "fp8"}}
    mine = {"model": SMOL, "build": {"quantization": "fp8", "calibration": ref}}
    d = es.normalize_build_spec(fp8)
    assert d["calibration_data"] == {"sha256": es.DEFAULT_CALIBRATION_SHA256}  # the shipped mixture, by content
    assert es.normalize_build_spec(mine)["calibration_data"] == {"sha256": ref["checksum"]}
    assert es.engine_hash(mine) != es.engine_hash(fp8)
    moved = {"model": SMOL, "build": {"quantization": "fp8", "calibration": {**ref, "pvc": {"claimName": "e", "path": "b.jsonl"}}}}
    assert es.engine_hash(moved) == es.engine_hash(mine)  # the same bytes elsewhere: the same engine
    other = {"model": SMOL, "build": {"quantization": "fp8", "calibration": {**ref, "checksum": "sha256:" + "2" * 64}}}
    assert es.engine_hash(other) != es.engine_hash(mine)
    kv = {"model": SMOL, "build": {"kvCacheDtype": "fp8", "calibration": ref}}
    assert es.engine_hash(kv) != es.engine_hash({"model": SMOL, "build": {"kvCacheDtype": "fp8"}})
    none = {"model": SMOL, "build": {"calibration": ref}}
    assert "calibration_data" not in es.normalize_build_spec(none)
    assert es.engine_hash(none) == es.engine_hash({"model": SMOL})


def test_cli_and_crd_spellings_agree():
    crd = es.BuildSpec.from_dict({"model": SMOL, "build": {"quantization": "int4-awq", "groupSize": 64}})
    cli = es.BuildSpec.from_cli("builtin:smollm2-135m-instruct", quantization="int4-awq", group_size=64)
    assert crd.hash() == cli.hash()
    hf = es.BuildSpec.from_cli("hf://org/m@abc")
    assert hf.hash() == es.engine_hash({"model": {"huggingFace": {"repo": "org/m", "revision": "abc"}}})


def test_build_args_round_trip_to_the_same_hash():
    import argparse

    for build in [{}, {"quantization": "int4-gptq", "groupSize": 32}, {"quantization": "int8-smoothquant", "smoothquantAlpha": "750m"},
                  {"quantization": "int4-awq", "quantizeLmHead": True},
                  {"kvCacheDtype": "fp8", "maxSeqLen": 1024}]:
        bs = es.BuildSpec.from_dict({"model": SMOL, "build": build})
        argv = bs.to_build_args("/engines/" + bs.hash())
        p = argparse.ArgumentParser()
        for flag in ("--model", "--output", "--quantization", "--group-size", "--smoothquant-alpha", "--kv-cache-dtype", "--source-checksum",
                     "--calibration-samples", "--max-seq-len", "--max-batch-size", "--max-num-tokens"):
            p.add_argument(flag)
        p.add_argument("--quantize-lm-head", action="store_true")
        a = p.parse_args(argv)
        back = es.BuildSpec.from_cli(a.model, quantization=a.quantization, group_size=a.group_size,
                                     smoothquant_alpha=a.smoothquant_alpha, kv_cache_dtype=a.kv_cache_dtype,
                                     calibration_samples=a.calibration_samples, max_seq_len=a.max_seq_len,
                                     max_batch_size=a.max_batch_size, max_num_tokens=a.max_num_tokens,
                                     quantize_lm_head=a.quantize_lm_head)
        assert back.hash() == bs.hash()
        assert a.output.endswith(bs.hash())


def test_is_engine_complete(tmp_path):
    d = tmp_path / "abc"
    d.mkdir()
    assert not manifest.is_engine_complete(str(d))
    (d / constants.MANIFEST_FILENAME).write_text(json.dumps({"format_version": constants.ENGINE_FORMAT_VERSION, "engine_hash": "abc123"}))
    assert not manifest.is_engine_complete(str(d))  # no marker yet: still being written
    (d / constants.COMPLETE_MARKER).write_text("")
    assert manifest.is_engine_complete(str(d))
    assert manifest.is_engine_complete(str(d), expected_hash="abc")
    assert not manifest.is_engine_complete(str(d), expected_hash="ffff")
    (d / constants.MANIFEST_FILENAME).write_text(json.dumps({"format_version": 999}))
    assert not manifest.is_engine_complete(str(d))
    (d / constants.MANIFEST_FILENAME).write_text("{truncated")
    assert not manifest.is_engine_complete(str(d))
    assert not manifest.is_engine_complete(str(tmp_path / "missing"))


def test_parse_quantity():
    assert es.parse_quantity("500m") == es.parse_quantity(0.5) == es.parse_quantity("0.5")
    assert es.parse_quantity("1Ki") == 1024
    for bad in (True, "abc", [1], float("nan")):
        with pytest.raises(es.EngineSpecError):
            es.parse_quantity(bad)


def test_enginespec_and_operator_do_not_import_torch():
    code = ("import sys, kiln.common.constants, kiln.common.enginespec, kiln.common.manifest,"
            " kiln.common.metrics, kiln.operator.main, kiln.operator.reconcile;"
            "bad=[m for m in sys.modules if m.split('.')[0] in ('torch','transformers','triton')"
            " or m.startswith('kiln.runtime')];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_build_bounds_are_the_crds():
    """`kiln build` refuses exactly what the API server refuses: the integer build fields'
    minimum and maximum in crds/inferenceengine.yaml equal enginespec.BUILD_INT_BOUNDS."""
    import pathlib

    import yaml

    crd = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "crds" / "inferenceengine.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["build"][
        "properties"]
    assert {k: (props[k]["minimum"], props[k]["maximum"]) for k in es.BUILD_INT_BOUNDS} == es.BUILD_INT_BOUNDS

