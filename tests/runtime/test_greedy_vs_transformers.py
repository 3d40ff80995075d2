"""Greedy outputs of Kiln on the embedded default equal transformers' on the same GGUF,
token for token, across batch shapes, chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import pytest

from prompts import MAX_NEW_TOKENS

pytestmark = pytest.mark.slow


def _greedy():
    from kiln.runtime import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _make_llm(**kw):
    from kiln.runtime import LLM

    return LLM(**kw)


def _assert_equal(outs, hf_greedy, prompt_token_ids):
    mismatches = []
    for i, (o, ref) in enumerate(zip(outs, hf_greedy)):
        got = o.outputs[0].token_ids
        if got != ref:
            mismatches.append((i, len(prompt_token_ids[i]), got, ref))
    assert not mismatches, "\n".join(f"prompt {i} ({n} tokens):\n kiln {g}\n   hf {r}" for i, n, g, r in mismatches)


def test_one_by_one(hf_greedy, prompt_token_ids):
    llm = _make_llm()
    outs = [llm.generate([ids], _greedy())[0] for ids in prompt_token_ids]
    _assert_equal(outs, hf_greedy, prompt_token_ids)


def test_batched(hf_greedy, prompt_token_ids):
    llm = _make_llm()
    outs = llm.generate(prompt_token_ids, _greedy())
    _assert_equal(outs, hf_greedy, prompt_token_ids)
    # Every block is back: nothing allocated outside the prefix cache.
    assert llm.engine.scheduler.kv_cache_manager.num_allocated_uncached_blocks == 0


def test_chunked_prefill_small_budget(hf_greedy, prompt_token_ids):
    llm = _make_llm(max_num_batched_tokens=32)
    outs = llm.generate(prompt_token_ids, _greedy())
    _assert_equal(outs, hf_greedy, prompt_token_ids)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching(hf_greedy, prompt_token_ids, prefix_caching):
    llm = _make_llm(enable_prefix_caching=prefix_caching)
    first = llm.generate(prompt_token_ids, _greedy())
    second = llm.generate(prompt_token_ids, _greedy())  # the second pass reuses cached blocks
    _assert_equal(first, hf_greedy, prompt_token_ids)
    _assert_equal(second, hf_greedy, prompt_token_ids)
    kv = llm.engine.scheduler.kv_cache_manager
    if prefix_caching:
        assert kv.prefix_cache_hits > 0
        assert sum(o.num_cached_tokens for o in second) > 0
    else:
        assert kv.prefix_cache_hits == 0


def test_preemption_small_pool(hf_greedy, prompt_token_ids):
    # 24 blocks of 16 tokens = 384 token slots for 16 prompts of 10..130 tokens + 24 new each.
    llm = _make_llm(num_kv_blocks=24, max_num_batched_tokens=128)
    outs = llm.generate(prompt_token_ids, _greedy())
    _assert_equal(outs, hf_greedy, prompt_token_ids)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.scheduler.kv_cache_manager.num_allocated_uncached_blocks == 0


def test_guaranteed_no_evict(hf_greedy, prompt_token_ids):
    llm = _make_llm(num_kv_blocks=24, max_num_batched_tokens=128, scheduler_policy="guaranteed_no_evict")
    outs = llm.generate(prompt_token_ids, _greedy())
    _assert_equal(outs, hf_greedy, prompt_token_ids)
    assert llm.engine.scheduler.num_preemptions_total == 0
