"""``kiln build`` and ``kiln eval`` refuse bad arguments up front, with a message that names the
problem, before loading or writing anything (no model is loaded here)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from types import SimpleNamespace

from kiln.runtime.build_cli import add_build_args, run_build


def cli(*argv: str) -> int:
    return run_build(add_build_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_mount_point_output_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    vol = tmp_path / "vol"
    vol.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == vol)
    # a missing source would fail too, later: the mount point must be reported first
    assert cli("--model", str(tmp_path / "nope"), "--output", str(vol)) == 2
    err = capsys.readouterr().err
    assert "is a mount point" in err and str(vol / "engine") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vol"] and not any(vol.iterdir())


def test_empty_output_is_refused(capsys):
    assert cli("--output", "", "--print-hash") == 2
    assert "--output must not be empty" in capsys.readouterr().err


def test_group_size_only_with_int4_methods(capsys):
    for method in ("none", "fp8", "int8-smoothquant"):
        assert cli("--output", "/x", "--quantization", method, "--group-size", "32", "--print-hash") == 2, method
        assert "--group-size applies only to int4-awq and int4-gptq" in capsys.readouterr().err
    assert cli("--output", "/x", "--quantization", "int4-awq", "--group-size", "32", "--print-hash") == 0
    assert cli("--output", "/x", "--quantization", "none", "--print-hash") == 0


def test_smoothquant_alpha_only_with_smoothquant(capsys):
    for method in ("none", "fp8", "int4-awq", "int4-gptq"):
        assert cli("--output", "/x", "--quantization", method, "--smoothquant-alpha", "0.9", "--print-hash") == 2
        assert "--smoothquant-alpha applies only to int8-smoothquant" in capsys.readouterr().err
    assert cli("--output", "/x", "--quantization", "int8-smoothquant", "--smoothquant-alpha", "0.9",
               "--print-hash") == 0
    default = capsys.readouterr().out
    assert cli("--output", "/x", "--quantization", "int8-smoothquant", "--smoothquant-alpha", "0.5",
               "--print-hash") == 0
    assert cli("--output", "/x", "--quantization", "int8-smoothquant", "--print-hash") == 0
    same = capsys.readouterr().out.split()
    assert same[0] == same[1] != default.strip()  # 0.5 is the default; 0.9 another engine


def test_build_limits_are_bounded_as_in_the_crd(capsys):
    assert cli("--output", "/x", "--max-batch-size", "100000000", "--print-hash") == 2
    assert "--max-batch-size: 100000000 is above the maximum 4096" in capsys.readouterr().err
    assert cli("--output", "/x", "--max-num-tokens", "8", "--print-hash") == 2
    assert "--max-num-tokens: 8 is below the minimum 16" in capsys.readouterr().err


def test_source_checksum_is_checked_before_hashing(capsys):
    assert cli("--output", "/x", "--source-checksum", "md5:abc", "--print-hash") == 2
    assert "unsupported checksum algorithm 'md5'" in capsys.readouterr().err
    assert cli("--output", "/x", "--source-checksum", "abc", "--print-hash") == 2
    assert "expected sha256:<hex>" in capsys.readouterr().err
    assert cli("--output", "/x", "--source-checksum", "sha256:abc", "--print-hash") == 2
    assert "not a sha256 digest" in capsys.readouterr().err
    assert cli("--output", "/x", "--source-checksum", "SHA256:" + "A" * 64, "--print-hash") == 0


def test_eval_text_is_a_directory(tmp_path, capsys):
    from kiln.runtime.eval import main

    assert main(["perplexity", "--model", "builtin:smollm2-135m-instruct", "--text", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_eval_text_not_utf8_names_the_file(tmp_path):
    import pytest

    from kiln.runtime.eval import read_text

    f = tmp_path / "weights.bin"
    f.write_bytes(b"abc\xb7\xff\x00")
    with pytest.raises(ValueError, match=f"{f}: not UTF-8 text") as e:
        read_text(str(f))
    assert "0xb7 at offset 3" in str(e.value)


def test_eval_window_above_the_context_is_refused(tmp_path, monkeypatch, capsys):
    from kiln.runtime import eval as eval_mod

    monkeypatch.setattr(eval_mod, "open_model", lambda *a, **k: SimpleNamespace(max_model_len=64))
    text = tmp_path / "t.txt"
    text.write_text("Some text. " * 20)
    assert eval_mod.main(["perplexity", "--model", "builtin:x", "--text", str(text), "--window", "65"]) == 2
    assert "--window 65 is longer than the model's context of 64 tokens" in capsys.readouterr().err


def test_eval_window_past_4096_and_the_context_names_the_window(tiny_model, tmp_path, capsys):
    """A window past 4096 becomes the engine's max_model_len; past the model's context the
    error names --window, not max_model_len alone (real tiny model, no stub)."""
    from kiln.runtime import eval as eval_mod

    text = tmp_path / "t.txt"
    text.write_text("Some text. " * 20)
    assert eval_mod.main(["perplexity", "--model", str(tiny_model), "--text", str(text), "--window", "100000"]) == 2
    assert "--window 100000 is longer than the model's context" in capsys.readouterr().err


def test_eval_bad_text_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """An empty or binary --text is refused before any model is opened (loading takes seconds)."""
    from kiln.runtime import eval as eval_mod

    def no_load(*a, **k):
        raise AssertionError("the model was opened before the text was checked")

    monkeypatch.setattr(eval_mod, "open_model", no_load)
    empty = tmp_path / "e.txt"
    empty.write_text("  \n")
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\x00\xff\xfe")
    for f, needle in ((empty, "the text is empty"), (binary, "not UTF-8 text")):
        assert eval_mod.main(["perplexity", "--model", "builtin:x", "--text", str(f)]) == 2
        assert needle in capsys.readouterr().err
