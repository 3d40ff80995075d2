"""``kiln head fetch`` (the operator's Job for an EAGLE head from the Hub) through the real
``kiln`` parser: a folder or a Hub repository (a local mirror) is checked as ``kiln serve``
reads a head and written atomically with its completion marker; what the server would refuse
fails with its reason, exit 2, nothing written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kiln.common.enginecache import parse_build_report
from kiln.devcluster.hubserver import HubServer
from kiln.runtime.cli import main

from conftest import TINY_CONFIG

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from eagle_heads import write_random_head  # noqa: E402


def _fetch(*args: str) -> int:
    return main(["head", "fetch", *args])


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_fetch_a_folder(tmp_path, capsys, kind):
    src = write_random_head(tmp_path / "src", TINY_CONFIG, kind)
    out = tmp_path / "claim" / "0123456789abcdef"
    log = tmp_path / "termination-log"
    log.write_text("")
    assert _fetch("--source", str(src), "--output", str(out), "--termination-log", str(log)) == 0
    assert sorted(p.name for p in out.iterdir()) == [".kiln-complete", "config.json", "model.safetensors"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    report = parse_build_report(log.read_text())
    assert report["engineHash"] == out.name and report["bytes"] == sum(p.stat().st_size for p in out.iterdir())
    assert f"({kind})" in capsys.readouterr().err
    assert _fetch("--source", str(tmp_path / "gone"), "--output", str(out)) == 0  # complete: kept
    assert "already there" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "no-config", "no-weights", "not-a-head"])
def test_what_kiln_serve_would_refuse_is_refused_here(tmp_path, capsys, case):
    src = tmp_path / "src"
    if case != "missing":
        write_random_head(src, TINY_CONFIG, "eagle")
        if case == "no-config":
            (src / "config.json").unlink()
        if case == "no-weights":
            (src / "model.safetensors").unlink()
        if case == "not-a-head":  # a model folder: a config, weights, no fc
            from safetensors.torch import save_file
            import torch

            save_file({"model.norm.weight": torch.ones(4)}, str(src / "model.safetensors"))
    out = tmp_path / "out"
    log = tmp_path / "termination-log"
    log.write_text("")
    assert _fetch("--source", str(src), "--output", str(out), "--termination-log", str(log)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kiln head: error: ")
    assert ("NotFound" if case == "missing" else "InvalidHead") in err and log.read_text().strip() == err
    assert not out.exists()


def test_fetch_from_the_hub(tmp_path, monkeypatch):
    src = write_random_head(tmp_path / "src", TINY_CONFIG, "eagle3")
    (src / "README.md").write_text("not fetched")
    with HubServer() as hub:
        hub.add("org/tiny-eagle3", src, sha="c" * 40, token="hf_secret")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        out = tmp_path / "out"
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        assert _fetch("--source", "hf://org/tiny-eagle3", "--output", str(out),
                      "--download-dir", str(tmp_path / "cache")) == 2
        assert not out.exists()
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert _fetch("--source", "hf://org/tiny-eagle3@main", "--output", str(out),
                      "--download-dir", str(tmp_path / "cache")) == 0
        assert sorted(p.name for p in out.iterdir()) == [".kiln-complete", "config.json", "model.safetensors"]
        assert json.loads((out / "config.json").read_text())["draft_vocab_size"] > 0
