"""``kiln bench`` as a user runs it (subprocesses of the installed ``kiln``): bad input ends
early in one clear error and exit 2, and ``kiln bench serve --engine`` serves a Kiln engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KILN = str(Path(sys.executable).with_name("kiln"))
ENV = {**os.environ, "KILN_CPU_THREADS": "1"}


def kiln(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([KILN, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.parametrize("where", ["proc", "missing-dir", "a-dir"])
def test_bench_offline_unwritable_json_fails_before_the_benchmark(tmp_path, where):
    path = {"proc": "/proc/x.json", "missing-dir": str(tmp_path / "no" / "x.json"), "a-dir": str(tmp_path)}[where]
    r = kiln("bench", "offline", "--json", path, "--load-format", "dummy", "--num-prompts", "1",
             "--input-len", "4", "--output-len", "2")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "[bench]" not in r.stdout  # no model was loaded, nothing ran
    assert f"--json {path}" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bench_serve_nonexistent_model_is_one_error_line_and_exit_2():
    r = kiln("bench", "serve", "--model", "/nonexist", "--num-prompts", "1")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "kiln bench: error: the server did not start: kiln serve exited with code 2" in r.stderr
    assert "/nonexist" in r.stderr  # kiln serve's own error, above


def test_bench_serve_engine_and_model_conflict():
    r = kiln("bench", "serve", "--model", "a", "--engine", "b")
    assert r.returncode == 2
    assert "argument --engine: not allowed with argument --model" in r.stderr


def test_bench_serve_engine_is_refused_with_url():
    r = kiln("bench", "serve", "--url", "http://127.0.0.1:1", "--engine", "b")
    assert r.returncode == 2
    assert "--engine" in r.stderr and "--url" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bench_serve_engine_end_to_end(tmp_path):
    """An unquantized engine of the embedded model (~20 s to build on 2 cores), benchmarked with
    one short request through `kiln serve --engine`."""
    eng = tmp_path / "engine"
    b = kiln("build", "--output", str(eng), timeout=300)
    assert b.returncode == 0, b.stderr[-2000:]
    r = kiln("bench", "serve", "--engine", str(eng), "--num-prompts", "1", "--concurrency", "1",
             "--input-len", "4", "--output-len", "2", "--max-num-seqs", "1", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"errors": 0' in r.stdout and '"output_tokens": 2' in r.stdout, r.stdout
