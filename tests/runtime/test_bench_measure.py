"""``kiln bench``'s measurements on plain data: streams delivered at once, goodput, Poisson
and gamma arrivals, the lognormal length mix; and ``--quantization`` of random weights at load
producing tokens on the CPU."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from kiln.runtime.bench_common import SHAREGPT_MEAN_INPUT_LEN, make_lognormal_workload
from kiln.runtime.bench_serve import RequestResult, arrival_gaps, summarize


def _res(max_tokens, tokens, chunks, ttft=0.1, e2e=1.0):
    return RequestResult(max_tokens, None, ttft, e2e, tokens, chunks)


def test_a_stream_delivered_at_once_is_flagged():
    streamed = _res(4, 4, [0.1, 0.4, 0.7, 1.0])
    bulk = _res(4, 4, [1.0], ttft=1.0)
    one = _res(1, 1, [0.1])  # one token asked: one chunk is all a stream can do
    assert not streamed.bulk and bulk.bulk and not one.bulk
    row = summarize([streamed, bulk, one], 2.0, math.inf, 4, {})
    assert row["bulk_streams"] == 1 and row["errors"] == 0 and row["output_tokens"] == 9
    assert row["request_rate"] is None and row["concurrency"] == 4
    assert streamed.itl == pytest.approx([0.3, 0.3, 0.3]) and streamed.tpot == pytest.approx(0.3)
    assert row["itl_p50_s"] == pytest.approx(0.3)


def test_goodput_counts_requests_meeting_every_slo():
    fast = _res(4, 4, [0.1, 0.2, 0.3, 0.4], ttft=0.1, e2e=0.4)  # TPOT 0.1
    slow_start = _res(4, 4, [0.9, 1.0, 1.1, 1.2], ttft=0.9, e2e=1.2)
    slow_tokens = _res(4, 4, [0.1, 1.0, 2.0, 3.0], ttft=0.1, e2e=3.0)
    failed = RequestResult(4, "500: boom")
    row = summarize([fast, slow_start, slow_tokens, failed], 2.0, 5.0, None, {"ttft": 0.5, "tpot": 0.2})
    assert row["goodput_requests_s"] == pytest.approx(0.5)  # one of four requests, 2 s
    assert row["requests_s"] == pytest.approx(1.5) and row["errors"] == 1 and row["first_error"] == "500: boom"
    assert row["slo_s"] == {"ttft": 0.5, "tpot": 0.2}
    json.dumps(row)


def test_arrivals():
    assert arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5
    poisson = arrival_gaps(20000, 4.0, 1.0, 0)
    assert statistics.mean(poisson) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(poisson) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean
    bursty = arrival_gaps(20000, 4.0, 0.25, 0)
    assert statistics.mean(bursty) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(bursty) == pytest.approx(0.5, rel=0.1)  # gamma: sd = mean / sqrt(shape)
    assert arrival_gaps(10, 4.0, 1.0, 3) == arrival_gaps(10, 4.0, 1.0, 3)


def test_lognormal_mix_has_sharegpt_means_and_a_tail():
    wl = make_lognormal_workload(4000, SHAREGPT_MEAN_INPUT_LEN, 338, vocab_size=1000, seed=1)
    ins = [len(p) for p in wl.prompts]
    assert statistics.mean(ins) == pytest.approx(SHAREGPT_MEAN_INPUT_LEN, rel=0.1)
    assert statistics.mean(wl.output_lens) == pytest.approx(338, rel=0.1)
    assert statistics.median(ins) < 0.75 * statistics.mean(ins)  # right-skewed
    assert min(ins) >= 1 and max(ins) <= 4 * SHAREGPT_MEAN_INPUT_LEN
    assert all(100 <= t < 1000 for p in wl.prompts[:50] for t in p)


def _tiny(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 2}))
    return str(d)


@pytest.mark.parametrize("method,kind", [("fp8", "Fp8LinearMethod"), ("int4-awq", "Int4LinearMethod"),
                                         ("int4-gptq", "Int4LinearMethod"),
                                         ("int8-smoothquant", "Int8LinearMethod")])
def test_random_weights_quantized_at_load(tmp_path, method, kind):
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.model.layers import LinearBase

    llm = LLM(model=_tiny(tmp_path), load_format="dummy", quantization=method, device="cpu", num_kv_blocks=32)
    linears = [m for m in llm.engine.runner.model.model.layers.modules() if isinstance(m, LinearBase)]
    assert linears and {type(m.quant_method).__name__ for m in linears} == {kind}
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_quantized_at_load_refuses_a_group_size_that_does_not_divide(tmp_path):
    from kiln.runtime import LLM

    d = tmp_path / "odd"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "eos_token_id": 2}))
    with pytest.raises(ValueError, match="group size 128 does not divide"):
        LLM(model=str(d), load_format="dummy", quantization="int4-awq", device="cpu", num_kv_blocks=16)


def test_bulk_streams_are_warned_about(capsys):
    from kiln.runtime.bench_serve import _report_problems

    row = summarize([_res(4, 4, [1.0], ttft=1.0), _res(4, 4, [0.2, 0.5, 0.8, 1.0])], 1.0, math.inf, 16, {})
    _report_problems([row])
    err = capsys.readouterr().err
    assert "warning: 1 of 2 streams delivered all their tokens in one chunk (concurrency 16, rate inf)" in err
