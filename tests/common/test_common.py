"""kiln.common: torch-free, the one manifest reader and verifier, the metric table, and the
images that ship it."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.common import constants, manifest
from kiln.common.enginespec import BuildSpec
from kiln.common.metrics import LATENCY_BUCKETS, METRIC_NAMES, METRICS, metric

ROOT = Path(__file__).resolve().parents[2]


def test_common_and_operator_import_without_torch_or_the_runtime():
    code = ("import sys, kiln.common.constants, kiln.common.enginespec, kiln.common.manifest, kiln.common.metrics;"
            "common=[m for m in sys.modules if m.split('.')[0] in ('torch','transformers','triton','yaml','kopf')"
            " or m.startswith(('kiln.runtime', 'kiln.operator', 'kiln.kernels'))];"
            "import kiln.operator.main, kiln.operator.reconcile;"
            "operator=[m for m in sys.modules if m.split('.')[0] in ('torch','transformers','triton')"
            " or m.startswith(('kiln.runtime', 'kiln.kernels'))];"
            "print(common, operator); sys.exit(1 if common or operator else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def make_engine(path: Path) -> dict:
    """A finished engine folder without torch: one fake weight file and one tokenizer file,
    with the manifest ``kiln build`` would write for them."""
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "tokenizer.json").write_text("{}")
    spec = BuildSpec.from_dict({"model": {"builtin": "smollm2-135m-instruct"}})
    m = {"format_version": constants.ENGINE_FORMAT_VERSION, "engine_hash": spec.hash(), "build_spec": spec.to_dict(),
         "model": {"config": {}}, "quantization": {"method": "none"},
         "weights": {"files": [{"name": "model.safetensors", "bytes": 7,
                                "sha256": manifest.sha256_file(path / "model.safetensors")}]},
         "tokenizer_sha256": {"tokenizer.json": manifest.sha256_file(path / "tokenizer.json")}}
    m["manifest_sha256"] = manifest.manifest_digest(m)
    (path / constants.MANIFEST_FILENAME).write_text(json.dumps(m))
    (path / constants.COMPLETE_MARKER).write_text(spec.hash())
    return m


def test_verify_engine_accepts_a_whole_engine_and_names_what_is_wrong(tmp_path):
    m = make_engine(tmp_path / "e")
    assert manifest.verify_engine(tmp_path / "e") == m
    assert manifest.is_engine_complete(str(tmp_path / "e"), m["engine_hash"])
    assert manifest.spec_hash(m["build_spec"]) == m["engine_hash"]
    (tmp_path / "e" / "tokenizer.json").write_text("[]")
    with pytest.raises(manifest.EngineFormatError, match="checksum mismatch for tokenizer file"):
        manifest.verify_engine(tmp_path / "e")
    manifest.verify_engine(tmp_path / "e", verify_checksums=False)  # sizes only
    (tmp_path / "e" / "model.safetensors").write_bytes(b"weight")
    with pytest.raises(manifest.EngineFormatError, match="truncated"):
        manifest.verify_engine(tmp_path / "e", verify_checksums=False)


@pytest.mark.parametrize("content, match", [
    (None, "is not a Kiln engine"),
    ("{truncated", "cannot read manifest.json"),
    ("[1, 2]", "is not a JSON object"),
])
def test_read_manifest_errors(tmp_path, content, match):
    if content is not None:
        (tmp_path / constants.MANIFEST_FILENAME).write_text(content)
    with pytest.raises(manifest.EngineFormatError, match=match):
        manifest.read_manifest(tmp_path)
    assert not manifest.is_engine_complete(str(tmp_path))


# DESIGN.md's metric list (prefix kiln_): the table serves at least these.
DESIGN_METRICS = (
    "request_queue_time_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
    "e2e_request_latency_seconds", "num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio",
    "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "request_success_total",
)


def test_metric_table_holds_designs_list():
    assert len(METRIC_NAMES) == len(set(METRIC_NAMES))
    assert {"kiln_" + n for n in DESIGN_METRICS} <= set(METRIC_NAMES)
    assert all(n.startswith("kiln_") for n in METRIC_NAMES)
    assert all(m.name.endswith("_total") == (m.type == "counter") for m in METRICS)
    assert all(bool(m.buckets) == (m.type == "histogram") for m in METRICS)
    assert metric("kiln_request_queue_time_seconds").buckets == LATENCY_BUCKETS


def test_server_exposes_exactly_the_table():
    pytest.importorskip("prometheus_client")
    from kiln.runtime.server.metrics import Metrics

    text = Metrics("m").render().decode()
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, flags=re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    for m in METRICS:
        assert types[m.name] == m.type and helps[m.name] == m.help, m.name
    assert {n for n in types if not n.endswith("_created")} == set(METRIC_NAMES)


PRODUCT_FOLDERS = ("common", "runtime", "kernels", "operator")  # the source folders the images install


def test_images_copy_the_product_folders_and_setup_py():
    """setup.py maps each source folder into ``kiln``; an image that lacks one (or setup.py)
    builds a wheel without it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    roots = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_ROOTS")
    assert set(PRODUCT_FOLDERS) <= set(roots)
    for image in ("operator", "runtime"):
        copies = re.findall(r"^COPY (.+)$", (ROOT / "images" / image / "Dockerfile").read_text(), flags=re.M)
        sources = {word.rstrip("/") for line in copies for word in line.split()[:-1]}
        assert {"setup.py", "pyproject.toml", *PRODUCT_FOLDERS} <= sources, image


def test_build_progress_lines_round_trip_and_other_lines_are_not_progress():
    from kiln.common.progress import STAGES, BuildProgress, ProgressReporter, format_line, last_progress, parse_line

    p = BuildProgress("quantize", 3725, 12, 30, "calibrate+quantize: layer 12/30")
    line = format_line(p)
    assert line == "kiln build: [quantize 12/30 3725s] calibrate+quantize: layer 12/30"
    assert parse_line(line) == p and parse_line("2026-01-01T00:00:00.1Z " + line) == p
    assert p.summary() == "quantize 12/30, 1h02m" and BuildProgress("load", 59).summary() == "load, 59s"
    assert parse_line("kiln build: error: boom") is None and parse_line("kiln build: [nostage 1s] x") is None
    assert parse_line("INFO [quantize 1/2 3s]") is None
    clock = iter([100.0, 101.2, 104.9, 130.0])
    lines = []
    r = ProgressReporter(lines.append, clock=lambda: next(clock))
    r.stage("load", "loading")
    r.layer(1, 30)
    r("still in quantize? no: in load")
    assert [parse_line(x).elapsed_seconds for x in lines] == [1, 4, 30]
    assert last_progress("\n".join(lines + ["junk"])).message == "still in quantize? no: in load"
    assert last_progress("nothing here") is None
    with pytest.raises(ValueError, match="unknown build stage"):
        r.stage("compile")
    assert STAGES[0] == "source" and STAGES[-1] == "done"
