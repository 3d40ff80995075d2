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


# -- flags, through the real parser (in-process: no model is loaded) ----------------------------
def _parse(*args: str):
    from kiln.runtime.cli import build_parser

    return build_parser().parse_args(["bench", *args])


def test_serve_flags_parse():
    import math

    ns = _parse("serve", "--concurrency", "1,8,64,256", "--request-rate", "2,inf", "--burstiness", "0.5",
                "--goodput", "ttft:500", "tpot:50", "--dataset", "lognormal")
    assert ns.concurrency == [1, 8, 64, 256]
    assert ns.request_rate[0] == 2.0 and math.isinf(ns.request_rate[1])
    assert ns.goodput == [("ttft", 0.5), ("tpot", 0.05)]
    assert _parse("serve", "--max-concurrency", "4").concurrency == [4]  # vLLM's spelling, same setting
    ns = _parse("serve")
    assert ns.concurrency is None and math.isinf(ns.request_rate[0]) and ns.goodput is None


def test_offline_flags_parse():
    ns = _parse("offline", "--load-format", "dummy", "--quantization", "int4-gptq", "--dataset", "lognormal")
    assert ns.quantization == "int4-gptq" and ns.dataset == "lognormal"
    assert _parse("offline").quantization == "none"


@pytest.mark.parametrize("args,message", [
    (["serve", "--concurrency", "1,0"], "argument --max-concurrency/--concurrency: '1,0': must be at least 1"),
    (["serve", "--concurrency", "a"], "'a': 'a' is not an integer"),
    (["serve", "--request-rate", "0"], "argument --request-rate: must be above 0"),
    (["serve", "--request-rate", "x"], "'x' is not a number (or inf)"),
    (["serve", "--burstiness", "-1"], "argument --burstiness: must be a finite number above 0"),
    (["serve", "--goodput", "ttft"], "'ttft': expected METRIC:MS with METRIC one of ttft, tpot, itl, e2el"),
    (["serve", "--goodput", "p99:5"], "expected METRIC:MS"),
    (["serve", "--goodput", "tpot:-5"], "'tpot:-5': must be a finite number above 0"),
    (["serve", "--dataset", "sharegpt"], "invalid choice: 'sharegpt'"),
    (["offline", "--quantization", "int3"], "invalid choice: 'int3'"),
    (["offline", "--kv-cache-dtype", "int8"], "invalid choice: 'int8'"),
    (["serve", "--kv-cache-dtype", "fp8_e5m2"], "invalid choice: 'fp8_e5m2'"),
    (["offline", "--range-ratio", "1.5"], "must be in [0, 1)"),
])
def test_bad_flags_are_one_error_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(*args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("args,message", [
    (["serve", "--url", "http://127.0.0.1:1", "--burstiness", "2"], "--burstiness shapes the arrivals of "
                                                                    "--request-rate; give a finite rate"),
    (["serve", "--url", "http://127.0.0.1:1", "--goodput", "ttft:1", "ttft:2"], "--goodput names ttft twice"),
    (["serve", "--url", "http://127.0.0.1:1", "--dataset", "lognormal", "--range-ratio", "0.2"],
     "--range-ratio applies to --dataset random"),
    (["serve", "--url", "http://127.0.0.1:1", "--load-format", "dummy"], "configure the server started here"),
    (["serve", "--url", "http://127.0.0.1:1", "--kv-cache-dtype", "fp8"], "configure the server started here"),
    (["serve", "--engine", "e", "--load-format", "dummy"], "--load-format dummy applies to a --model"),
    (["serve", "--url", "http://127.0.0.1:1", "--json", "/proc/x.json"], "cannot write --json /proc/x.json"),
    (["offline", "--model", "m", "--quantization", "fp8"], "applies only to random weights (--load-format dummy)"),
    (["offline", "--model", "m", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 needs calibrated KV scales"),
    (["offline", "--load-format", "dummy", "--quantization", "fp8", "--peer", "transformers"],
     "cannot be compared with --quantization fp8"),
])
def test_bad_combinations_are_one_line_and_exit_2(args, message, capsys):
    """Refused before a server starts or a model loads: one line on stderr, exit 2."""
    from kiln.runtime.cli import main

    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_offline_quantization_refused_for_an_engine(tmp_path):
    from kiln.runtime.config import EngineArgs

    with pytest.raises(ValueError, match="an engine carries its own quantization"):
        EngineArgs(engine=str(tmp_path), quantization="int4-awq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model="m", load_format="dummy", quantization="int3")


def test_bench_offline_quantized_random_weights(tmp_path):
    """`kiln bench offline --quantization int4-awq --load-format dummy` on a tiny model (CPU)."""
    import json

    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "eos_token_id": 2}))
    out = tmp_path / "r.json"
    r = kiln("bench", "offline", "--model", str(d), "--load-format", "dummy", "--quantization", "int4-awq",
             "--device", "cpu", "--num-kv-blocks", "64", "--num-prompts", "3", "--dataset", "lognormal",
             "--input-len", "8", "--output-len", "4", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "int4-awq weights (round to nearest)" in r.stdout
    res = json.loads(out.read_text())["results"][0]
    assert res["quantization"] == "int4-awq" and res["output_tokens"] > 0


def test_started_server_arguments_parse_as_kiln_serve():
    """What `kiln bench serve` passes to the `kiln serve` it starts is a valid command line of
    the real parser, with each forwarded flag's value."""
    from kiln.runtime.bench_serve import server_args
    from kiln.runtime.cli import build_parser

    ns = _parse("serve", "--model", "builtin:llama-3.2-1b", "--load-format", "dummy", "--max-num-seqs", "8",
                "--kv-cache-dtype", "fp8")
    served = build_parser().parse_args(["serve", *server_args(ns, 8123)])
    assert (served.model, served.load_format, served.max_num_seqs, served.kv_cache_dtype, served.port) == \
        ("builtin:llama-3.2-1b", "dummy", 8, "fp8", 8123)
    plain = build_parser().parse_args(["serve", *server_args(_parse("serve", "--engine", "e"), 1)])
    assert (plain.engine, plain.kv_cache_dtype, plain.load_format) == ("e", "auto", "auto")
