"""LoRA adapters from files as a fresh user and the operator give them: a file instead of a
folder, a rank in the tensors other than the config's, ``--lora-dir`` confining paths, and
``--lora-modules-file`` (the operator's list) loading what it can at start."""

from __future__ import annotations

import json

import pytest

from kiln.devcluster.lora_adapters import write_random_adapter
from kiln.runtime.lora import LoRAError

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    (folder / "config.json").write_text(json.dumps(CFG))
    return folder


def _llm(base, **kw):
    from kiln.runtime import LLM

    return LLM(model=str(base), load_format="dummy", num_kv_blocks=64, max_num_batched_tokens=64,
               enable_lora=True, max_loras=2, max_lora_rank=16, **kw)


def test_files_and_ranks_say_what_is_wrong(base, tmp_path):
    from kiln.runtime.lora.peft_format import load_peft_adapter
    from kiln.runtime.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(CFG)
    a = write_random_adapter(tmp_path / "a", CFG, rank=8)
    with pytest.raises(LoRAError, match="is a file: it must be a PEFT adapter folder holding adapter_config.json") as e:
        load_peft_adapter(a / "adapter_model.safetensors", cfg, 16)
    assert e.value.reason == "InvalidAdapter"
    conf = json.loads((a / "adapter_config.json").read_text())
    (a / "adapter_config.json").write_text(json.dumps({**conf, "r": 4}))  # weights are rank 8
    with pytest.raises(LoRAError, match=r"has rank 8 .* but adapter_config.json says r=4") as e:
        load_peft_adapter(a, cfg, 16)
    assert e.value.reason == "InvalidAdapter"
    big = write_random_adapter(tmp_path / "big", CFG, rank=32)
    with pytest.raises(LoRAError, match="rank 32 is larger than --max-lora-rank 16; raise "
                                        "--max-lora-rank to 32") as e:
        load_peft_adapter(big, cfg, 16)
    assert e.value.reason == "RankTooLarge"
    (big / "adapter_config.json").write_text(json.dumps({**conf, "r": 8}))  # a config that hides the real rank
    with pytest.raises(LoRAError, match="has rank 32 .* larger than --max-lora-rank 16") as e:
        load_peft_adapter(big, cfg, 16)
    assert e.value.reason == "RankTooLarge"


def test_lora_dir_confines_paths(tmp_path):
    from kiln.runtime.lora.manager import LoRAConfig

    root = tmp_path / "adapters"
    conf = LoRAConfig(root=str(root))
    assert conf.resolve("k1") == (root / "k1").resolve()
    assert conf.resolve(str(root / "k1")) == (root / "k1").resolve()
    for bad in ("../k1", str(tmp_path / "elsewhere"), "/etc"):
        with pytest.raises(LoRAError, match="outside --lora-dir"):
            conf.resolve(bad)
    assert LoRAConfig().resolve("rel/k1").as_posix() == "rel/k1"  # no --lora-dir: any path


def test_modules_file_loads_what_it_can_at_start(base, tmp_path, caplog):
    from kiln.runtime import SamplingParams
    from kiln.runtime.cli import build_parser, engine_args_from

    root = tmp_path / "adapters"
    write_random_adapter(root / "good", CFG, rank=8, scale=4.0)
    write_random_adapter(root / "big", CFG, rank=32)
    listing = tmp_path / "adapters.json"
    listing.write_text(json.dumps({"good": "good", "big": "big", "gone": "gone", "out": "../x"}))
    ns = build_parser().parse_args(["serve", "--lora-dir", str(root), "--lora-modules-file", str(listing)])
    args = engine_args_from(ns)
    assert args.lora_enabled and args.lora_dir == str(root) and args.lora_modules_file == str(listing)
    llm = _llm(base, lora_dir=str(root), lora_modules_file=str(listing))
    assert [a.name for a in llm.list_loras()] == ["good"]
    skipped = "\n".join(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    for name, reason in (("big", "RankTooLarge"), ("gone", "NotFound"), ("out", "InvalidAdapter")):
        assert f"LoRA adapter {name} from {listing} skipped: {reason}" in skipped, skipped
    from kiln.runtime import LoRARequest

    sp = SamplingParams(max_tokens=4, temperature=0.0)
    base_out, lora_out = llm.generate([[5, 6, 7, 8], [5, 6, 7, 8]], sp, lora_request=[None, LoRARequest("good")])
    assert base_out.outputs[0].token_ids != lora_out.outputs[0].token_ids  # the adapter is really in
    with pytest.raises(LoRAError, match="outside --lora-dir"):
        llm.add_lora("escape", str(tmp_path))
    listing.write_text("[1, 2]")
    with pytest.raises(ValueError, match="--lora-modules-file .* expected a JSON object"):
        _llm(base, lora_modules_file=str(listing))
