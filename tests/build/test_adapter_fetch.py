"""``kiln adapter fetch`` (the operator's adapter Job) through the real ``kiln`` parser: a
folder or a Hub repository (a local mirror) is checked against an engine and written
atomically; what the server would refuse fails here with its reason, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest

from kiln.devcluster.hubserver import HubServer
from kiln.devcluster.lora_adapters import write_random_adapter
from kiln.runtime.cli import main

from conftest import TINY_CONFIG


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, tiny_model):
    from kiln.common.enginespec import BuildSpec
    from kiln.runtime.build import build_engine

    root = tmp_path_factory.mktemp("engine")
    return build_engine(BuildSpec.from_cli(str(tiny_model)), str(tiny_model), root / "e", device="cpu").path


def _fetch(*args: str) -> int:
    return main(["adapter", "fetch", *args])


def test_fetch_folder_checked_against_the_engine(tiny_engine, tmp_path, capsys):
    src = write_random_adapter(tmp_path / "src", TINY_CONFIG, rank=8)
    out = tmp_path / "claim" / ".adapters" / "k1"
    assert _fetch("--source", str(src), "--output", str(out), "--engine", str(tiny_engine)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert _fetch("--source", str(tmp_path / "gone"), "--output", str(out), "--engine", str(tiny_engine)) == 0
    assert "already there" in capsys.readouterr().err


@pytest.mark.parametrize("case, reason", [("missing", "NotFound"), ("file", "InvalidAdapter"),
                                          ("rank", "RankTooLarge"), ("shape", "ShapeMismatch")])
def test_refused_adapters_write_nothing(tiny_engine, tmp_path, capsys, case, reason):
    src = tmp_path / "src"
    if case == "file":
        src.write_text("not a folder")
    elif case == "rank":
        write_random_adapter(src, TINY_CONFIG, rank=32)
    elif case == "shape":
        write_random_adapter(src, {**TINY_CONFIG, "hidden_size": 96}, rank=4)  # another base's shapes
    log = tmp_path / "termination-log"
    log.write_text("")
    out = tmp_path / "out"
    assert _fetch("--source", str(src), "--output", str(out), "--engine", str(tiny_engine),
                  "--termination-log", str(log)) == 2
    err = capsys.readouterr().err
    assert f"kiln adapter: error: {reason}:" in err
    assert log.read_text().startswith(f"kiln adapter: error: {reason}:")
    assert not out.exists()
    if case == "file":
        assert "must be a PEFT adapter folder" in err
    if case == "rank":
        assert "larger than --max-lora-rank 16" in err


def test_fetch_from_the_hub(tiny_engine, tmp_path, monkeypatch):
    src = write_random_adapter(tmp_path / "src", TINY_CONFIG, rank=4, targets=["q_proj", "v_proj"])
    (src / "README.md").write_text("not fetched")
    with HubServer() as hub:
        hub.add("org/tiny-lora", src, sha="a" * 40, token="hf_secret")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        out = tmp_path / "out"
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        assert _fetch("--source", "hf://org/tiny-lora", "--output", str(out), "--engine", str(tiny_engine),
                      "--download-dir", str(tmp_path / "cache")) == 2
        assert not out.exists()
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert _fetch("--source", "hf://org/tiny-lora@main", "--output", str(out), "--engine", str(tiny_engine),
                      "--download-dir", str(tmp_path / "cache")) == 0
        assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_CONFIG))
        hub.add("org/a-model", model, sha="b" * 40)
        assert _fetch("--source", "hf://org/a-model", "--output", str(tmp_path / "o2")) == 2  # a model, no adapter
