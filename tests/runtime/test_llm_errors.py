"""The offline API refuses malformed prompts and messages with clear errors and keeps working."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from kiln.runtime import LLM

    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 2}))
    return LLM(model=str(d), load_format="dummy", num_kv_blocks=64)


@pytest.mark.parametrize("bad", [None, 5, {"a": 1}, [[1, "x"]], [3.5]])
def test_bad_prompts(llm, bad):
    with pytest.raises(TypeError):
        llm.generate(bad)


def test_bad_requests_leave_engine_usable(llm):
    from kiln.runtime import SamplingParams
    from kiln.runtime.engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[1, 999]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="512"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=10_000))
    with pytest.raises(TypeError):
        llm.generate([[1, 2]], {"max_tokens": 2})
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="integer"):
        SamplingParams(max_tokens=2.5)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.scheduler.kv_cache_manager.num_allocated_uncached_blocks == 0


def test_chat_message_validation(llm):
    with pytest.raises(ValueError, match="must not be empty"):
        llm.chat([])
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([[{"role": "user", "content": "hi"}], []])
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ValueError, match="content"):
        llm.chat([{"role": "user"}])


def test_max_model_len_above_the_models_context_is_refused(tmp_path):
    from kiln.runtime import LLM

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 2}))
    with pytest.raises(ValueError, match="max_model_len 1024 is larger than the model's context length .512"):
        LLM(model=str(tmp_path), load_format="dummy", num_kv_blocks=64, max_model_len=1024)
    assert LLM(model=str(tmp_path), load_format="dummy", num_kv_blocks=64, max_model_len=512).engine.max_model_len == 512


def test_max_model_len_too_small_is_refused(tmp_path):
    from kiln.runtime import LLM

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 2}))
    for bad in (1, 0, -5):
        with pytest.raises(ValueError, match=f"max_model_len must be at least 2.*got {bad}"):
            LLM(model=str(tmp_path), load_format="dummy", num_kv_blocks=64, max_model_len=bad)


def test_min_tokens_beyond_the_context_is_refused(llm):
    from kiln.runtime import SamplingParams
    from kiln.runtime.engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="min_tokens .1000. is more than the 510 tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=None, min_tokens=1000))
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=3, min_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs,match", [
    ({"logprobs": 1.5}, "logprobs must be an integer"), ({"logprobs": "3"}, "logprobs must be an integer"),
    ({"logprobs": True}, "logprobs must be an integer"), ({"stop": [1]}, "stop must be"),
    ({"stop_token_ids": 5}, "stop_token_ids must be"), ({"logit_bias": [1]}, "logit_bias must be a dict"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False"), ({"detokenize": 0}, "detokenize must be"),
])
def test_sampling_params_types(kwargs, match):
    """Wrongly typed settings fail when the SamplingParams is made, not inside a step."""
    from kiln.runtime import SamplingParams

    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_failing_step_aborts_the_call_and_frees_its_blocks(llm, monkeypatch):
    """A step that raises (any runtime error) ends the generate call with that error, aborts its
    requests and frees their KV blocks: the LLM keeps serving."""
    from kiln.runtime import SamplingParams

    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate(["a"], [None])
    runner = llm.engine.runner
    free = llm.engine.scheduler.kv_cache_manager.num_free_blocks
    orig = runner.execute
    calls = {"n": 0}

    def flaky(out, rows, *rest):
        calls["n"] += 1
        if calls["n"] == 3:  # fail mid-generation, with blocks allocated
            raise RuntimeError("injected device error")
        return orig(out, rows, *rest)

    monkeypatch.setattr(runner, "execute", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[1, 2, 3] * 20, [4, 5]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_manager.num_free_blocks == free
    monkeypatch.setattr(runner, "execute", orig)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
