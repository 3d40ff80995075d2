"""``kiln build`` on a tiny random Llama: every method builds, loads back without the source,
matches the in-memory quantization, is deterministic, and bad input fails cleanly."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from kiln.runtime import build as build_mod
from kiln.runtime.build import BadInputError, BuildError, build_engine
from kiln.runtime.build_cli import add_build_args, run_build
from kiln.common.constants import COMPLETE_MARKER, MANIFEST_FILENAME
from kiln.common.enginespec import BuildSpec, engine_hash
from kiln.common.manifest import EngineFormatError, manifest_digest
from kiln.runtime.engine_folder import open_engine

METHODS = ["none", "fp8", "int8-smoothquant", "int4-awq", "int4-gptq", "kv-fp8", "int4-awq-lm-head",
           "int4-gptq-lm-head"]


def cli(*argv: str) -> int:
    p = add_build_args(argparse.ArgumentParser())
    return run_build(p.parse_args(list(argv)))


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name] if parent.exists() else []


# -- hash ------------------------------------------------------------------------------------
def test_hash_is_enginespecs(capsys):
    assert cli("--model", "builtin:smollm2-135m-instruct", "--output", "/nonexistent", "--quantization", "int4-awq",
               "--print-hash") == 0
    h = capsys.readouterr().out.strip()
    assert h == engine_hash({"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "int4-awq"}})
    # equivalent spelling, same hash
    assert cli("--model", "builtin:SmolLM2-135M-Instruct", "--output", "/x", "--quantization", "INT4_AWQ",
               "--group-size", "128", "--print-hash") == 0
    assert capsys.readouterr().out.strip() == h


# -- every method ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", METHODS)
def test_engine_manifest_and_layout(tiny_engines, name):
    eng = open_engine(tiny_engines[name])
    m = eng.manifest
    assert (eng.path / COMPLETE_MARKER).is_file()
    assert m["engine_hash"] == eng.path.name or len(m["engine_hash"]) == 16
    assert m["source"]["sha256"].startswith("sha256:") and m["builder"]["version"]
    assert "tokenizer.json" in m["tokenizer_files"]
    assert m["kv_cache_dtype"] == ("fp8" if name == "kv-fp8" else "auto")
    assert oct((eng.path).stat().st_mode)[-3:] == "755"


@pytest.mark.parametrize("name", METHODS)
def test_engine_serves_without_source(tiny_engines, tiny_model, tmp_path, name):
    """LLM(engine=...) loads from the engine alone (source moved away) and its logits stay
    close to the float model's."""
    from kiln.runtime.eval import open_model, score_windows

    text = "The quick brown fox jumps over the lazy dog. " * 8
    ref_eng = open_model(model=str(tiny_model), window=64)
    ids = list(ref_eng.tokenizer(text, add_special_tokens=False)["input_ids"])
    ref, ref_top = score_windows(ref_eng, ids, 64, want_argmax=True)
    hidden = tmp_path / "moved"
    shutil.move(str(tiny_model), hidden)
    try:
        eng = open_model(engine=str(tiny_engines[name]), window=64)
        got, top = score_windows(eng, ids, 64, want_argmax=True)
    finally:
        shutil.move(str(hidden), tiny_model)
    bound = {"none": 1e-6, "fp8": 0.05, "int8-smoothquant": 0.05, "int4-awq": 0.2, "int4-gptq": 0.2, "kv-fp8": 0.05,
             "int4-awq-lm-head": 0.25, "int4-gptq-lm-head": 0.25}
    assert abs(got.nll - ref.nll) / ref.nll < bound[name]
    if name == "none":
        assert torch.equal(top, ref_top)


def test_llm_generate_from_engine(tiny_engines):
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(engine=str(tiny_engines["int4-awq"]), device="cpu", num_kv_blocks=64)
    out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize("method", ["int4-awq", "int4-gptq"])
def test_quantized_lm_head(tiny_engines, method):
    """--quantize-lm-head stores the head as int4 (the tied embedding table stays float and
    untouched), records it in the manifest and the hash, and the runtime serves the head with
    the int4 method."""
    from safetensors import safe_open

    from kiln.runtime.eval import open_model
    from kiln.runtime.quantization.int4 import Int4LinearMethod

    plain, quant = open_engine(tiny_engines[method]), open_engine(tiny_engines[f"{method}-lm-head"])
    assert quant.manifest["quantization"]["lm_head"] is True and "lm_head" not in plain.manifest["quantization"]
    assert quant.manifest["build_spec"]["quantization"]["lm_head"] is True
    assert quant.manifest["engine_hash"] != plain.manifest["engine_hash"]

    def tensors(eng):
        out = {}
        for f in eng.weight_files():
            with safe_open(str(f), framework="pt") as sf:
                out.update({n: sf.get_tensor(n) for n in sf.keys()})
        return out

    tq, tp = tensors(quant), tensors(plain)
    assert {"lm_head.qweight", "lm_head.scales", "lm_head.qzeros"} <= set(tq) and "lm_head.weight" not in tq
    assert not any(n.startswith("lm_head.") for n in tp)  # tied: the plain engine stores no head
    assert torch.equal(tq["model.embed_tokens.weight"], tp["model.embed_tokens.weight"])  # the lookup table
    assert tq["lm_head.qweight"].shape == (64 // 8, 49152) and tq["lm_head.scales"].shape == (64 // 32, 49152)

    eng = open_model(engine=str(tiny_engines[f"{method}-lm-head"]), window=32)
    head = eng.runner.model.lm_head
    assert isinstance(head.quant_method, Int4LinearMethod) and "weight" not in head._parameters
    logits = eng.runner.model.compute_logits(torch.randn(3, 64))
    assert logits.dtype == torch.float32 and logits.shape == (3, 49152)


def test_quantize_lm_head_flag_needs_an_int4_method(tmp_path, capsys):
    assert cli("--model", "builtin:smollm2-135m-instruct", "--output", str(tmp_path / "e"), "--quantization", "fp8",
               "--quantize-lm-head") == 2
    assert "--quantize-lm-head applies only to int4-awq and int4-gptq" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_kv_fp8_engine_uses_fp8_cache(tiny_engines):
    from kiln.runtime.eval import open_model

    eng = open_model(engine=str(tiny_engines["kv-fp8"]), window=32)
    assert eng.runner.kv_cache_dtype() == torch.float8_e4m3fn
    attn = eng.runner.model.attention_layers()[0]
    assert attn.k_cache.dtype == torch.float8_e4m3fn and attn.k_scale.shape == (2, 1) and bool((attn.k_scale > 0).all())


def test_fp8_kv_cache_flag_against_the_engines_own(tiny_engines):
    """--kv-cache-dtype fp8 serves an engine with calibrated KV scales and refuses one without."""
    from kiln.runtime import LLM

    llm = LLM(engine=str(tiny_engines["kv-fp8"]), kv_cache_dtype="fp8", num_kv_blocks=16)
    assert llm.engine.runner.kv_cache_dtype() == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="has no FP8 KV scales .built with --kv-cache-dtype auto.: rebuild it"):
        LLM(engine=str(tiny_engines["fp8"]), kv_cache_dtype="fp8", num_kv_blocks=16)


# -- determinism -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(quantization="int4-gptq", group_size=32), dict(quantization="fp8"),
                                dict(quantization="int4-awq", group_size=32, kv_cache_dtype="fp8")])
def test_deterministic(tiny_model, tmp_path, kw):
    spec = BuildSpec.from_cli(str(tiny_model), calibration_samples=3, **kw)
    a = build_engine(spec, str(tiny_model), tmp_path / "a", device="cpu")
    b = build_engine(spec, str(tiny_model), tmp_path / "b", device="cpu")
    assert a.engine_hash == b.engine_hash == spec.hash()
    ma = json.loads((a.path / MANIFEST_FILENAME).read_text())
    mb = json.loads((b.path / MANIFEST_FILENAME).read_text())
    assert ma == mb
    for f in ma["weights"]["files"]:
        assert (a.path / f["name"]).read_bytes() == (b.path / f["name"]).read_bytes()


def test_rebuild_same_path_is_noop(tiny_engines, tiny_model):
    spec = BuildSpec.from_cli(str(tiny_model), quantization="fp8", calibration_samples=4)
    res = build_engine(spec, str(tiny_model), tiny_engines["fp8"], device="cpu")
    assert res.status == "exists"


# -- bad input -------------------------------------------------------------------------------
def test_unknown_method(tmp_path, capsys):
    assert cli("--output", str(tmp_path / "e"), "--quantization", "int3-magic") == 2
    assert "int3-magic" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_group_size_must_divide(tiny_model, tmp_path, capsys):
    # hidden 64 is not a multiple of 128
    assert cli("--model", str(tiny_model), "--output", str(tmp_path / "e"), "--quantization", "int4-gptq",
               "--group-size", "128", "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert "group size 128 does not divide" in err and "[32, 64]" in err
    assert not (tmp_path / "e").exists() and not leftovers(tmp_path)
    assert cli("--model", str(tiny_model), "--output", str(tmp_path / "e"), "--quantization", "int4-awq",
               "--group-size", "48") == 2
    assert "--group-size: 48 is not one of" in capsys.readouterr().err


def test_max_seq_len_past_the_models_context(tiny_model, tmp_path, capsys):
    # the tiny model's context is 512 tokens
    assert cli("--model", str(tiny_model), "--output", str(tmp_path / "e"), "--max-seq-len", "1024",
               "--device", "cpu") == 2
    assert "--max-seq-len 1024 is longer than the model's context of 512 tokens" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not leftovers(tmp_path)


def test_source_without_a_tokenizer_is_refused_before_quantizing(tiny_model, tmp_path, capsys, monkeypatch):
    src = tmp_path / "no-tok"
    shutil.copytree(tiny_model, src)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    from kiln.runtime import quantization

    def no_quantizing(*a):
        raise AssertionError("quantization started before the tokenizer was checked")

    monkeypatch.setattr(quantization, "get_handler", no_quantizing)
    assert cli("--model", str(src), "--output", str(tmp_path / "e"), "--quantization", "int4-awq",
               "--group-size", "32", "--calibration-samples", "2", "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert "no tokenizer in" in err and "Traceback" not in err
    assert not (tmp_path / "e").exists() and not leftovers(tmp_path)


def test_build_limits_bound_the_batch_when_serving(tiny_model, tmp_path):
    """An engine's --max-batch-size and --max-num-tokens are the serving defaults' caps (64
    sequences, 2048 tokens when larger); an explicit larger --max-num-seqs or
    --max-num-batched-tokens is refused, as TensorRT-LLM's runtime refuses a batch past its
    engine's; a model served directly keeps the defaults."""
    from kiln.runtime import LLM, SamplingParams

    path = build_engine(BuildSpec.from_cli(str(tiny_model), max_batch_size=2, max_num_tokens=32), str(tiny_model),
                        tmp_path / "e", device="cpu").path
    llm = LLM(engine=str(path), device="cpu", num_kv_blocks=32)
    cfg = llm.engine.scheduler.config
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (2, 32)
    outs = llm.generate([[5] * 40, [6] * 3, [7] * 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
    with pytest.raises(ValueError, match="--max-num-seqs 3 is larger than the engine's build limit 2"):
        LLM(engine=str(path), device="cpu", num_kv_blocks=32, max_num_seqs=3)
    with pytest.raises(ValueError, match="--max-num-batched-tokens 64 is larger than the engine's build limit 32"):
        LLM(engine=str(path), device="cpu", num_kv_blocks=32, max_num_batched_tokens=64)
    small = LLM(engine=str(path), device="cpu", num_kv_blocks=32, max_num_seqs=1, max_num_batched_tokens=16)
    assert (small.engine.scheduler.config.max_num_seqs, small.engine.scheduler.config.max_num_batched_tokens) == (1, 16)
    direct = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=32).engine.scheduler.config
    assert (direct.max_num_seqs, direct.max_num_batched_tokens) == (64, 2048)
    with pytest.raises(ValueError, match="dummy"):
        LLM(engine=str(path), device="cpu", load_format="dummy")


def test_unsupported_architecture(tmp_path, capsys):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert cli("--model", str(src), "--output", str(tmp_path / "e")) == 2
    assert "unsupported architecture" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not leftovers(tmp_path)


def test_corrupt_safetensors(tiny_model, tmp_path, capsys):
    src = tmp_path / "corrupt"
    shutil.copytree(tiny_model, src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 3])
    assert cli("--model", str(src), "--output", str(tmp_path / "e"), "--device", "cpu") == 2
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not leftovers(tmp_path)


def test_truncated_gguf(tmp_path, capsys):
    from kiln.runtime import loader

    gguf = loader.resolve_source(None).path
    bad = tmp_path / "truncated.gguf"
    with open(gguf, "rb") as f:
        bad.write_bytes(f.read(1 << 16))
    os.environ["KILN_CACHE_DIR"] = str(tmp_path / "cache")
    try:
        assert cli("--model", str(bad), "--output", str(tmp_path / "e")) == 2
    finally:
        del os.environ["KILN_CACHE_DIR"]
    assert "GGUF" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_missing_source(tmp_path, capsys):
    assert cli("--model", str(tmp_path / "nope"), "--output", str(tmp_path / "e")) == 2
    assert "does not exist" in capsys.readouterr().err


def test_read_only_output(tiny_model, capsys):
    # /proc is read-only even for root
    assert cli("--model", str(tiny_model), "--output", "/proc/kiln-engine/e", "--device", "cpu") == 1
    assert "cannot write" in capsys.readouterr().err


def test_disk_full_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(build_mod, "_save_weights", full)
    spec = BuildSpec.from_cli(str(tiny_model), quantization="fp8")
    with pytest.raises(BuildError, match="no space left"):
        build_engine(spec, str(tiny_model), tmp_path / "e", device="cpu")
    assert not (tmp_path / "e").exists() and not leftovers(tmp_path)


def test_existing_foreign_output(tiny_model, tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "something").write_text("x")
    spec = BuildSpec.from_cli(str(tiny_model))
    with pytest.raises(BuildError, match="not a complete engine"):
        build_engine(spec, str(tiny_model), tmp_path / "e", device="cpu")
    assert (tmp_path / "e" / "something").read_text() == "x"


def test_output_under_a_file(tiny_model, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BuildError, match=f"cannot create {tmp_path}/afile/x: {tmp_path}/afile is a file, not a folder"):
        build_engine(BuildSpec.from_cli(str(tiny_model)), str(tiny_model), tmp_path / "afile" / "x", device="cpu")
    assert (tmp_path / "afile").read_text() == "x"


def test_existing_engine_of_another_spec(tiny_engines, tiny_model):
    """An --output that holds a finished engine of a different spec names both hashes."""
    other = open_engine(tiny_engines["int4-gptq"]).manifest["engine_hash"]
    spec = BuildSpec.from_cli(str(tiny_model), quantization="int4-gptq", group_size=32, quantize_lm_head=True)
    with pytest.raises(BuildError, match=f"holds engine {other}, built from a different spec than this one "
                                         f"\\({spec.hash()}\\)"):
        build_engine(spec, str(tiny_model), tiny_engines["int4-gptq"], device="cpu")
    assert open_engine(tiny_engines["int4-gptq"], verify=True).manifest["engine_hash"] == other


def test_stale_temp_folders_of_killed_builds_are_removed(tiny_model, tmp_path):
    """A build killed hard (SIGKILL) leaves its temporary folder; the next build next to it
    removes folders of dead builders on this host and old ones, and keeps a live builder's."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    killed = tmp_path / ".e.tmp-killed"
    live = tmp_path / ".e.tmp-live"
    old = tmp_path / ".e.tmp-old"
    for d, pid in ((killed, dead.pid), (live, os.getpid()), (old, None)):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
        if pid is not None:
            (d / build_mod._BUILDER_MARKER).write_text(f"{host}\n{pid}\n")
    os.utime(old, (1, 1))  # untouched for decades
    res = build_engine(BuildSpec.from_cli(str(tiny_model)), str(tiny_model), tmp_path / "e", device="cpu")
    assert res.status == "built"
    assert not killed.exists() and not old.exists() and live.exists()
    assert not (tmp_path / "e" / build_mod._BUILDER_MARKER).exists()
    open_engine(tmp_path / "e")


def test_race_loser_keeps_winner(tiny_engines, tiny_model, tmp_path, monkeypatch):
    """Another builder renames the same engine into place first: this one discards its copy."""
    spec = BuildSpec.from_cli(str(tiny_model), quantization="fp8", calibration_samples=4)
    out = tmp_path / spec.hash()
    real = build_mod._build_into

    def racing(*a, **k):
        real(*a, **k)
        shutil.copytree(tiny_engines["fp8"], out)  # the winner lands while we finish

    monkeypatch.setattr(build_mod, "_build_into", racing)
    res = build_engine(spec, str(tiny_model), out, device="cpu")
    assert res.status == "raced"
    open_engine(out)
    assert not leftovers(tmp_path)


# -- refusing bad engines ----------------------------------------------------------------------
@pytest.fixture
def engine_copy(tiny_engines, tmp_path):
    dst = tmp_path / "eng"
    shutil.copytree(tiny_engines["int4-gptq"], dst)
    return dst


def test_refuses_other_format_version(engine_copy):
    m = json.loads((engine_copy / MANIFEST_FILENAME).read_text())
    m["format_version"] = 999
    (engine_copy / MANIFEST_FILENAME).write_text(json.dumps(m))
    with pytest.raises(EngineFormatError, match="format version 999"):
        open_engine(engine_copy)
    from kiln.runtime import LLM

    with pytest.raises(EngineFormatError, match="rebuild"):
        LLM(engine=str(engine_copy), device="cpu", num_kv_blocks=8)


def test_refuses_modified_weights(engine_copy):
    f = engine_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(EngineFormatError, match="checksum mismatch"):
        open_engine(engine_copy)


def test_refuses_truncated_weights(engine_copy):
    f = engine_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(EngineFormatError, match="truncated"):
        open_engine(engine_copy)


def test_refuses_incomplete_and_edited_manifest(engine_copy):
    m = json.loads((engine_copy / MANIFEST_FILENAME).read_text())
    m["build_spec"]["quantization"]["group_size"] = 64
    (engine_copy / MANIFEST_FILENAME).write_text(json.dumps(m))
    with pytest.raises(EngineFormatError, match="does not match its build spec"):
        open_engine(engine_copy)
    (engine_copy / COMPLETE_MARKER).unlink()
    with pytest.raises(EngineFormatError, match="incomplete"):
        open_engine(engine_copy)


def test_refuses_a_manifest_without_its_checksum_and_a_file_for_a_folder(engine_copy, tmp_path):
    m = json.loads((engine_copy / MANIFEST_FILENAME).read_text())
    del m["manifest_sha256"]
    (engine_copy / MANIFEST_FILENAME).write_text(json.dumps(m))
    with pytest.raises(EngineFormatError, match="manifest lacks 'manifest_sha256'"):
        open_engine(engine_copy)
    (tmp_path / "f").write_text("x")
    with pytest.raises(EngineFormatError, match="is a file, not an engine folder"):
        open_engine(tmp_path / "f")


def _write_manifest(engine: Path, m: dict) -> None:
    """Write a manifest with a matching manifest_sha256, so the checks behind it are reached."""
    m = dict(m)
    m["manifest_sha256"] = manifest_digest(m)
    (engine / MANIFEST_FILENAME).write_text(json.dumps(m))


def test_refuses_short_hash_and_weights_outside_the_folder(engine_copy, tmp_path):
    m = json.loads((engine_copy / MANIFEST_FILENAME).read_text())
    good = dict(m)
    m["engine_hash"] = m["engine_hash"][:1]
    _write_manifest(engine_copy, m)
    with pytest.raises(EngineFormatError, match="does not match its build spec"):
        open_engine(engine_copy)
    m = dict(good)
    m["weights"] = {"files": [{**good["weights"]["files"][0], "name": "../elsewhere.safetensors"}]}
    _write_manifest(engine_copy, m)
    with pytest.raises(EngineFormatError, match="not a file inside"):
        open_engine(engine_copy)
    m["weights"] = "x"
    _write_manifest(engine_copy, m)
    with pytest.raises(EngineFormatError, match="malformed weights"):
        open_engine(engine_copy)


def test_refuses_edited_model_config_and_modified_tokenizer(engine_copy):
    m = json.loads((engine_copy / MANIFEST_FILENAME).read_text())
    assert m["manifest_sha256"] == manifest_digest(m)
    assert m["tokenizer_sha256"] and set(m["tokenizer_sha256"]) <= set(m["tokenizer_files"])
    open_engine(engine_copy)
    # the model config is not part of the engine hash; the manifest digest covers it
    edited = json.loads(json.dumps(m))
    edited["model"]["config"]["num_hidden_layers"] += 1
    (engine_copy / MANIFEST_FILENAME).write_text(json.dumps(edited))
    with pytest.raises(EngineFormatError, match="manifest.json was modified"):
        open_engine(engine_copy)
    (engine_copy / MANIFEST_FILENAME).write_text(json.dumps(m))
    name = sorted(m["tokenizer_sha256"])[0]
    with open(engine_copy / name, "ab") as f:
        f.write(b" ")
    with pytest.raises(EngineFormatError, match="checksum mismatch for tokenizer file"):
        open_engine(engine_copy)
    (engine_copy / name).unlink()
    with pytest.raises(EngineFormatError, match="tokenizer file .* is missing"):
        open_engine(engine_copy)


def test_rebuild_over_a_corrupt_engine_fails_instead_of_reporting_it_built(tiny_engines, tiny_model, tmp_path, capsys):
    out = tmp_path / "eng"
    shutil.copytree(tiny_engines["int4-gptq"], out)
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    rc = cli("--model", str(tiny_model), "--output", str(out), "--quantization", "int4-gptq", "--group-size", "32",
             "--calibration-samples", "4")
    assert rc == 1 and "fails verification" in capsys.readouterr().err


def test_eval_bad_text_and_windows(tiny_engines, capsys, tmp_path):
    from kiln.runtime.eval import main

    eng = str(tiny_engines["none"])
    assert main(["perplexity", "--engine", eng, "--text", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    empty = tmp_path / "e.txt"
    empty.write_text("")
    assert main(["perplexity", "--engine", eng, "--text", str(empty)]) == 2
    assert "nothing to score" in capsys.readouterr().err
    assert main(["perplexity", "--engine", eng, "--text", os.devnull]) == 2  # exists, reads empty
    assert "nothing to score" in capsys.readouterr().err
    text = tmp_path / "t.txt"
    text.write_text("Some text. " * 20)
    for flag, value in (("--window", "0"), ("--window", "1"), ("--max-tokens", "0")):
        assert main(["perplexity", "--engine", eng, "--text", str(text), flag, value]) == 2, flag
        assert "at least 2" in capsys.readouterr().err
    for flag, value, want in (("--max-tokens", "-5", "--max-tokens must be at least 2, got -5"),
                              ("--max-tokens", "0", "--max-tokens must be at least 2, got 0"),
                              ("--num-prompts", "0", "--num-prompts must be at least 1, got 0"),
                              ("--new-tokens", "0", "--new-tokens must be at least 1, got 0")):
        assert main(["agreement", eng, eng, "--text", str(text), flag, value]) == 2, flag
        assert want in capsys.readouterr().err


def test_eval_cli(tiny_engines, capsys, tmp_path):
    from kiln.runtime.eval import main

    text = tmp_path / "t.txt"
    text.write_text("Some held-out English text for the tiny model. " * 10)
    assert main(["perplexity", "--engine", str(tiny_engines["fp8"]), "--text", str(text), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["num_tokens"] > 50 and r["perplexity"] > 1
    assert main(["perplexity", "--engine", str(tmp_path / "none"), "--text", str(text)]) == 2


def test_eval_agreement(tiny_engines, tmp_path, monkeypatch):
    from kiln.runtime.eval import agreement

    text = tmp_path / "t.txt"
    text.write_text("Agreement between two engines, measured on a short English text. " * 12)
    same = agreement(str(tiny_engines["none"]), str(tiny_engines["none"]), str(text), num_prompts=2, new_tokens=4)
    assert same["teacher_forced_top1"] == 1.0 and same["greedy_token_agreement"] == 1.0
    assert same["greedy_identical"] == same["num_prompts"] == 2
    r = agreement(str(tiny_engines["none"]), str(tiny_engines["int4-gptq"]), str(text), num_prompts=2, new_tokens=4)
    assert 0.0 <= r["teacher_forced_top1"] <= 1.0 and 0.0 <= r["greedy_token_agreement"] <= 1.0
    # prompts run one at a time: a huge --num-prompts costs no KV memory (it was sized per prompt)
    import kiln.runtime.eval as ev

    pools = []
    orig = ev.open_model
    monkeypatch.setattr(ev, "open_model", lambda *a, **k: pools.append(orig(*a, **k)) or pools[-1])
    many = agreement(str(tiny_engines["none"]), str(tiny_engines["none"]), str(text), num_prompts=100000,
                     new_tokens=2, window=64)
    assert many["num_prompts"] >= 2 and all(e.args.num_kv_blocks <= 64 for e in pools), \
        [e.args.num_kv_blocks for e in pools]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="nothing to compare"):
        agreement(str(tiny_engines["none"]), str(tiny_engines["none"]), str(empty), num_prompts=2, new_tokens=2)


def test_kiln_cli_wiring(tiny_model, tmp_path, capsys, monkeypatch):
    from kiln.runtime.cli import main

    out = tmp_path / "eng"
    shared = tmp_path / ".compile-cache"  # what the operator's build Job names
    monkeypatch.setenv("KILN_COMPILE_CACHE_DIR", str(shared))
    assert main(["build", "--model", str(tiny_model), "--output", str(out), "--quantization", "fp8",
                 "--device", "cpu"]) == 0
    assert str(out) in capsys.readouterr().out
    assert shared.is_dir() and shared.stat().st_mode & 0o7777 == 0o2775  # the pods' group may write
    assert main(["eval", "perplexity", "--engine", str(out), "--text", str(tiny_model / "config.json")]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_sigterm_removes_the_unfinished_engine(tmp_path):
    """Kubernetes stops a build Job's pod with SIGTERM: exit 143, nothing left behind."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "eng"
    env = {**os.environ, "KILN_CPU_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.runtime.build_cli", "--model", "builtin:smollm2-135m-instruct",
                             "--output", str(out), "--quantization", "int4-gptq", "--group-size", "32",
                             "--calibration-samples", "8"], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not leftovers(tmp_path):  # wait until it writes its temp folder
        time.sleep(0.2)
    assert leftovers(tmp_path), "the build never started writing"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "terminated" in err
    assert not out.exists() and not leftovers(tmp_path)


def test_engine_build_limit_caps_the_served_context(tiny_model, tmp_path):
    """An engine built with --max-seq-len L serves at most L tokens of context: the default
    max_model_len is capped to L, a larger explicit one is refused, a longer prompt is a
    request error."""
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.build import build_engine
    from kiln.runtime.engine import InvalidRequestError
    from kiln.common.enginespec import BuildSpec

    path = build_engine(BuildSpec.from_cli(str(tiny_model), max_seq_len=64), str(tiny_model), tmp_path / "e",
                        device="cpu").path
    llm = LLM(engine=str(path), device="cpu", num_kv_blocks=32)
    assert llm.engine.max_model_len == 64
    with pytest.raises(InvalidRequestError, match="64"):
        llm.generate([[5] * 80], SamplingParams(max_tokens=2))
    assert len(llm.generate([[5] * 20], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="build limit"):
        LLM(engine=str(path), device="cpu", num_kv_blocks=32, max_model_len=128)
    assert LLM(engine=str(path), device="cpu", num_kv_blocks=32, max_model_len=48).engine.max_model_len == 48
