"""``kiln bench``'s measurements on plain data: streams delivered at once, goodput, Poisson
and gamma arrivals, the lognormal length mix; and ``--quantization`` of random weights at load
producing tokens on the CPU."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

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


def test_random_weights_with_an_fp8_kv_cache(tmp_path):
    """--kv-cache-dtype fp8 with random weights: an E4M3 cache with scales for the init, under
    which the cached K/V rarely saturate and dequantize to the float32 cache's values within
    E4M3's rounding."""
    from kiln.runtime import LLM, SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]]
    model = _tiny(tmp_path)
    kw = dict(model=model, load_format="dummy", quantization="fp8", device="cpu", num_kv_blocks=32,
              enable_prefix_caching=False)
    llm = LLM(kv_cache_dtype="fp8", **kw)
    assert llm.engine.runner.kv_cache_dtype() == torch.float8_e4m3fn
    attn = llm.engine.runner.model.attention_layers()[0]
    assert attn.k_cache.dtype == torch.float8_e4m3fn and attn.k_scale.shape == (2, 1)
    assert torch.allclose(attn.k_scale, torch.full((2, 1), 6 * 0.02 * 128 ** 0.5 / 448))
    assert all(len(o.outputs[0].token_ids) == 8 for o in llm.generate(prompts, sp))
    one = SamplingParams(max_tokens=1, temperature=0.0)  # the prompts' K/V only: the same inputs on both sides
    llm = LLM(kv_cache_dtype="fp8", **kw)
    llm.generate(prompts, one)
    attn = llm.engine.runner.model.attention_layers()[0]
    plain = LLM(**kw)
    assert plain.engine.runner.kv_cache_dtype() == torch.float32
    plain.generate(prompts, one)
    ref = plain.engine.runner.model.attention_layers()[0]
    for cache, scale, want in ((attn.k_cache, attn.k_scale, ref.k_cache), (attn.v_cache, attn.v_scale, ref.v_cache)):
        used = want != 0  # the slots both engines wrote (the same block ids: one allocator order)
        assert used.sum() > 100
        assert (cache.float().abs()[used] >= 448).float().mean() < 0.01  # the range fits the init
        got = (cache.float() * scale.view(1, 1, 2, 1))[used]
        assert (got - want[used]).norm() / want[used].norm() < 0.05  # E4M3: 3 mantissa bits


def test_fp8_kv_cache_refused_without_scales(tmp_path):
    from kiln.runtime.config import EngineArgs

    with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs calibrated KV scales"):
        EngineArgs(model=_tiny(tmp_path), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8, got 'int8'"):
        EngineArgs(model="m", load_format="dummy", kv_cache_dtype="int8")


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
