"""Calibration data: the file formats, the round-robin samples over domains, the shipped
mixture, ``kiln build --calibration-data`` (errors, the engine hash, the manifest) and
``kiln eval perplexity --domains``."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from kiln.common.enginespec import DEFAULT_CALIBRATION_SHA256
from kiln.runtime.build_cli import add_build_args, run_build
from kiln.runtime.quantization.calibration_data import (
    CalibrationDataError,
    Record,
    default_calibration_path,
    domain_streams,
    heldout_domains,
    read_records,
    record_token_ids,
    samples_from_streams,
)


def cli(*argv: str) -> int:
    return run_build(add_build_args(argparse.ArgumentParser()).parse_args(list(argv)))


class CharTokenizer:
    """One token per character (ids = code points), EOS 0, no chat template."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_hf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_hf.path))


CHAT = {"messages": [{"role": "user", "content": "Bonjour !"}, {"role": "assistant", "content": "Salut."}]}


def test_plain_text_and_jsonl_records(tmp_path):
    t = tmp_path / "a.txt"
    t.write_text("just some prose\n")
    assert read_records(t) == [Record("text", text="just some prose\n")]
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"text": "x = 1", "domain": "code", "source": "me"}) + "\n\n" + json.dumps(CHAT) + "\n")
    recs = read_records(j)
    assert recs[0] == Record("code", text="x = 1")
    assert recs[1].domain == "text" and recs[1].messages[1] == {"role": "assistant", "content": "Salut."}
    k = tmp_path / "c.data"  # JSONL by content, whatever the name
    k.write_text(json.dumps({"text": "y"}) + "\n")
    assert read_records(k) == [Record("text", text="y")]


@pytest.mark.parametrize("body, message", [
    (b"", "the file is empty"),
    (b"  \n\n", "the file is empty"),
    (b"\xff\xfe text", "not UTF-8 text (byte 0xff at offset 0)"),
    (b'{"text": "ok"}\n{"text": \n', "line 2: not JSON"),
    (b'{"text": "ok"}\n[1, 2]\n', "line 2: expected a JSON object"),
    (b'{"prompt": "x"}\n', "line 1: needs exactly one of \"text\" or \"messages\""),
    (b'{"text": "a", "messages": []}\n', "needs exactly one of"),
    (b'{"text": ""}\n', "\"text\" must be a non-empty string"),
    (b'{"messages": []}\n', "\"messages\" must be a non-empty list"),
    (b'{"messages": [{"role": "user"}]}\n', "messages[0] needs string \"role\" and \"content\""),
    (b'{"text": "a", "domain": 3}\n', "\"domain\" must be a non-empty string"),
])
def test_malformed_files_name_the_file_and_line(tmp_path, body, message):
    f = tmp_path / "d.jsonl"
    f.write_bytes(body)
    with pytest.raises(CalibrationDataError) as e:
        read_records(f)
    assert message in str(e.value) and str(f) in str(e.value) and "\n" not in str(e.value)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(CalibrationDataError, match="no such file"):
        read_records(tmp_path / "nope.txt")
    with pytest.raises(CalibrationDataError, match="is a directory"):
        read_records(tmp_path)


def test_samples_go_round_robin_over_domains():
    tok = CharTokenizer()
    recs = [Record("a", text="a" * 50), Record("b", text="b" * 20), Record("a", text="A" * 29), Record("c", text="c" * 5)]
    streams = domain_streams(recs, tok)
    assert streams["a"] == [97] * 50 + [0] + [65] * 29  # EOS between a domain's records
    samples, taken = samples_from_streams(streams, 4, 40)
    assert [s[0] for s in samples] == [97, 98, 99, 97] and [len(s) for s in samples] == [40, 20, 5, 40]
    assert taken == {"a": 2, "b": 1, "c": 1}
    samples, taken = samples_from_streams({"a": list(range(90))}, 10, 40)
    assert [len(s) for s in samples] == [40, 40]  # a 10-token tail (< 32) is dropped
    with pytest.raises(ValueError, match="at least 1"):
        samples_from_streams(streams, 0, 40)


def test_chats_render_through_the_chat_template(smollm_tokenizer):
    ids = record_token_ids(Record("chat", messages=tuple(CHAT["messages"])), smollm_tokenizer)
    text = smollm_tokenizer.decode(ids)
    assert "<|im_start|>user\nBonjour !<|im_end|>" in text and text.rstrip().endswith("Salut.<|im_end|>")
    plain = record_token_ids(Record("chat", messages=tuple(CHAT["messages"])), CharTokenizer())
    assert "".join(map(chr, plain)) == "user: Bonjour !\nassistant: Salut."  # a base model's tokenizer


def test_the_shipped_mixture_covers_every_domain(smollm_tokenizer):
    from kiln.runtime.quantization.calibration import calibration_samples_by_domain

    path = default_calibration_path()
    assert "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() == DEFAULT_CALIBRATION_SHA256, \
        "the default calibration data changed: update DEFAULT_CALIBRATION_SHA256 (every engine hash changes)"
    samples, taken = calibration_samples_by_domain(smollm_tokenizer, 128)
    assert len(samples) == 128 and all(len(s) <= 128 for s in samples)
    assert set(taken) == {"chat", "text", "code", "multilingual", "docstrings", "numbers"}
    assert min(taken.values()) >= 5 and taken["chat"] >= 30
    _, small = calibration_samples_by_domain(smollm_tokenizer, 8)
    assert len(small) == 6  # eight samples still see every domain


def test_heldout_domains_differ_from_the_calibration_text():
    doms = heldout_domains()
    assert set(doms) == {"prose", "dialogue", "code", "markdown", "multilingual", "docstrings"}
    cal = default_calibration_path().read_text(encoding="utf-8")
    for name, p in doms.items():
        for r in read_records(p, default_domain=name) if p.suffix == ".jsonl" else [Record(name, text=p.read_text())]:
            for part in (r.text or "\n".join(m["content"] for m in r.messages)).split("\n\n"):
                if len(part) > 80:
                    assert part not in cal, (name, part[:60])


def test_calibration_data_errors_exit_2_before_any_work(tmp_path, capsys):
    out = tmp_path / "engine"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for data, message in ((tmp_path / "missing.txt", "no such file"), (empty, "the file is empty"),
                          (bad, "line 2: not JSON"), (tmp_path, "is a directory")):
        assert cli("--output", str(out), "--quantization", "fp8", "--calibration-data", str(data)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("kiln build: error: --calibration-data ") and message in err and "\n" not in err
    good = tmp_path / "good.txt"
    good.write_text("some calibration text\n")
    assert cli("--output", str(out), "--calibration-data", str(good)) == 2  # quantization none does not calibrate
    assert "--calibration-data applies only to builds that calibrate" in capsys.readouterr().err
    assert cli("--output", str(out), "--quantization", "fp8", "--calibration-checksum", "sha256:" + "0" * 64) == 2
    assert "--calibration-checksum needs --calibration-data" in capsys.readouterr().err
    assert cli("--output", str(out), "--quantization", "fp8", "--calibration-data", str(good),
               "--calibration-checksum", "sha256:" + "0" * 64) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert cli("--output", str(out), "--quantization", "fp8", "--calibration-data", str(good),
               "--calibration-checksum", "md5:00") == 2
    assert "--calibration-checksum: unsupported checksum algorithm" in capsys.readouterr().err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty.txt", "good.txt"]


def test_the_data_bytes_are_part_of_the_engine_hash(tmp_path, capsys):
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "sub" / "c.txt"
    c.parent.mkdir()
    a.write_text("one text\n")
    b.write_text("another text\n")
    c.write_text("one text\n")

    def h(*extra: str) -> str:
        assert cli("--output", "/x", "--quantization", "int4-gptq", "--group-size", "64", "--print-hash", *extra) == 0
        return capsys.readouterr().out.strip()

    default, ha, hb, hc = h(), h("--calibration-data", str(a)), h("--calibration-data", str(b)), h("--calibration-data", str(c))
    assert len({default, ha, hb}) == 3 and ha == hc  # different data, different engine; same bytes, same engine
    assert h("--calibration-data", str(default_calibration_path())) == default  # the default, by content
    sha = "sha256:" + hashlib.sha256(a.read_bytes()).hexdigest()
    assert h("--calibration-data", str(a), "--calibration-checksum", sha.upper().replace("SHA256", "sha256")) == ha


def test_build_with_jsonl_chats_records_the_data_in_the_manifest(tiny_model, tmp_path, capsys):
    data = tmp_path / "mine.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {**CHAT, "domain": "chat"}, {"text": "def f(x):\n    return x * 2\n" * 30, "domain": "code"},
        {"text": "Il pleuvait sur la ville depuis le matin. " * 10, "domain": "prose"}]) + "\n")
    out = tmp_path / "engine"
    assert cli("--model", str(tiny_model), "--output", str(out), "--quantization", "int8-smoothquant",
               "--calibration-data", str(data), "--calibration-samples", "16", "--device", "cpu") == 0
    err = capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    per = m["calibration"]["samples_per_domain"]
    assert list(per) == ["chat", "code", "prose"] and per["chat"] == 1 and per["code"] >= 2
    assert "calibration: " + ", ".join(f"{d} {n}" for d, n in per.items()) + " samples" in err
    cal = m["calibration"]
    assert cal["data"] == str(data) and cal["data_sha256"] == "sha256:" + hashlib.sha256(data.read_bytes()).hexdigest()
    assert cal["samples_used"] == sum(per.values())
    assert m["build_spec"]["calibration_data"] == {"sha256": cal["data_sha256"]}


def test_eval_perplexity_per_domain(tiny_model, tmp_path, capsys):
    from kiln.runtime.eval import main

    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n")
    assert main(["perplexity", "--model", str(tiny_model), "--domains", "prose,dialogue", "--text", str(mine),
                 "--max-tokens", "64", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["domains"]
    assert list(res) == ["prose", "dialogue", "mine"]
    assert res["prose"]["num_tokens"] == 63 and res["dialogue"]["num_tokens"] == 63 and res["mine"]["num_tokens"] > 10
    assert all(r["perplexity"] > 1 for r in res.values())
    assert main(["perplexity", "--model", str(tiny_model), "--domains", "poetry"]) == 2
    assert "--domains: unknown domain 'poetry'; shipped: code, dialogue, docstrings" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["perplexity", "--model", str(tmp_path / "no-model"), "--text", str(bad)]) == 2
    assert "line 1: not JSON" in capsys.readouterr().err  # the text is checked before the model loads
