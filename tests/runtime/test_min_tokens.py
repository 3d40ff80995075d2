"""``min_tokens``: EOS, stop ids and stop strings cannot end an output before it has that many
tokens (CPU, a tiny random Llama; both scheduling modes)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_holds_back_stop_ids_and_eos(model_dir, async_scheduling):
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(model=model_dir, load_format="dummy", num_kv_blocks=64, async_scheduling=async_scheduling)
    g = torch.Generator().manual_seed(0)
    for name, p in llm.engine.runner.model.named_parameters():
        if "norm" not in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    prompt = [5, 17, 33, 60, 61, 90]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    t0 = free.token_ids[0]
    # without min_tokens the first token stops the output
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[t0]))[0].outputs[0]
    assert stopped.token_ids == [t0] and stopped.finish_reason == "stop"
    for eos_too in (False, True):
        ban = [t0] + ([2] if eos_too else [])
        llm.engine.eos_token_ids = {2}
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5,
                                                    stop_token_ids=[t0]))[0].outputs[0]
        assert len(out.token_ids) >= 5, out.token_ids
        assert not set(out.token_ids[:5]) & set(ban), out.token_ids
        # after min_tokens the stop id ends the output again (if it comes), else the length does
        assert out.finish_reason == ("stop" if t0 in out.token_ids[5:] or 2 in out.token_ids[5:] else "length")
    # min_tokens == max_tokens: exactly max_tokens, no stop
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6,
                                                stop_token_ids=[t0]))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length" and t0 not in out.token_ids


def test_min_tokens_validation():
    from kiln.runtime import SamplingParams

    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="must not exceed max_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens="2")
