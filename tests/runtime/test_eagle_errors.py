"""EAGLE heads that cannot serve a target are refused when the engine loads, with the reason,
never later in a step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from eagle_heads import write_random_head  # noqa: E402


def _target(folder: Path, layers: int) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1,
           "eos_token_id": 2}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize("layers", [2, 6])
def test_eagle3_head_on_a_target_without_three_distinct_layers_is_refused(tmp_path, layers):
    from kiln.runtime import LLM

    cfg = _target(tmp_path / "target", layers)
    head = write_random_head(tmp_path / "head", cfg, "eagle3")
    with pytest.raises(ValueError, match=f"only {layers} layers"):
        LLM(model=str(tmp_path / "target"), load_format="dummy", num_kv_blocks=64, speculative_method="eagle",
            speculative_model=str(head), num_speculative_tokens=2)


def test_eagle3_head_on_seven_layers_loads_and_drafts(tmp_path):
    from kiln.runtime import LLM, SamplingParams

    cfg = _target(tmp_path / "target", 7)
    head = write_random_head(tmp_path / "head", cfg, "eagle3")
    llm = LLM(model=str(tmp_path / "target"), load_format="dummy", num_kv_blocks=64, speculative_method="eagle",
              speculative_model=str(head), num_speculative_tokens=2)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                         detokenize=False))
    assert len(out[0].outputs[0].token_ids) == 6
    assert llm.engine.core.spec.stats.num_draft_tokens > 0
