"""``kiln bench serve`` against a real ``kiln serve`` of a tiny random-weight model that has the
synthetic tokenizer: every token is a streamed chunk, so TTFT, TPOT and ITL come from chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln_server import start_server, stop_server

KILN = str(Path(sys.executable).with_name("kiln"))


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from kiln.runtime.synthetic_tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}))
    build_tokenizer(512, 1, [2]).save_pretrained(str(d))
    s = start_server("--model", str(d), "--load-format", "dummy", "--device", "cpu", "--num-kv-blocks", "128",
                     "--max-num-seqs", "8")
    yield s
    stop_server(s)


def bench(url: str, tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "bench.json"
    r = subprocess.run([KILN, "bench", "serve", "--url", url, "--vocab-size", "512", "--json", str(out), *args],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "KILN_CPU_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text())["results"]


def test_ttft_tpot_itl_from_chunks_and_a_concurrency_sweep(tiny_server, tmp_path):
    r, rows = bench(tiny_server.base, tmp_path, "--num-prompts", "6", "--input-len", "16", "--output-len", "12",
                    "--range-ratio", "0", "--concurrency", "1,4", "--goodput", "ttft:60000", "e2el:60000")
    assert [row["concurrency"] for row in rows] == [1, 4]
    for row in rows:
        assert row["errors"] == 0 and row["output_tokens"] == 6 * 12
        assert row["bulk_streams"] == 0 and row["chunks_per_request_mean"] > 1
        assert 0 < row["ttft_mean_s"] < row["e2e_mean_s"]
        assert row["tpot_p50_s"] > 0 and row["itl_p50_s"] is not None
        assert row["goodput_requests_s"] == pytest.approx(row["requests_s"])  # generous SLOs: every request
    table = r.stdout.strip().splitlines()[-3:]  # header and one line per run
    assert table[0].split()[:2] == ["conc", "rate"] and table[1].split()[0] == "1" and table[2].split()[0] == "4"
    assert "warning" not in r.stderr


def test_poisson_arrivals_and_the_lognormal_mix(tiny_server, tmp_path):
    _, rows = bench(tiny_server.base, tmp_path, "--num-prompts", "8", "--dataset", "lognormal", "--input-len", "8",
                    "--output-len", "6", "--request-rate", "40", "--burstiness", "0.5", "--max-concurrency", "4")
    assert len(rows) == 1 and rows[0]["request_rate"] == 40 and rows[0]["concurrency"] == 4
    assert rows[0]["errors"] == 0 and rows[0]["requests"] == 8
