"""A malformed config.json is refused with one clear error naming the field and its value
(UnsupportedModelError, which ``kiln build`` and ``kiln serve`` turn into one line and exit 2),
not with a traceback or a model of impossible shape."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kiln.runtime.model.config import ModelConfig, UnsupportedModelError

GOOD = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}
SIZE_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings"]
REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]


def edited(**changes) -> dict:
    """GOOD with ``changes`` applied; a value of ``...`` removes the key."""
    d = dict(GOOD, **changes)
    return {k: v for k, v in d.items() if v is not ...}


@pytest.mark.parametrize("value, kind", [([1, 2], "list"), (None, "null"), ("x", "str"), (3, "int")])
def test_config_that_is_not_an_object(value, kind):
    with pytest.raises(UnsupportedModelError, match=f"^config.json: expected a JSON object, got {kind}$"):
        ModelConfig.from_hf_dict(value)


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", [0, -2, "big", True, 4096.5, [64]])
def test_size_fields_must_be_positive_integers(field, value):
    msg = f"config.json: {field} must be a positive integer, got {value!r}"
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf_dict(edited(**{field: value}))
    assert str(e.value) == msg


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field_is_named(field):
    with pytest.raises(UnsupportedModelError, match=f"^config.json: required field {field} is missing"):
        ModelConfig.from_hf_dict(edited(**{field: ...}))


def test_head_counts_must_divide():
    with pytest.raises(UnsupportedModelError,
                       match=r"num_attention_heads \(4\) must be divisible by num_key_value_heads \(3\)"):
        ModelConfig.from_hf_dict(edited(num_key_value_heads=3))
    # without head_dim, it is hidden_size / num_attention_heads: that must divide too
    with pytest.raises(UnsupportedModelError, match=r"hidden_size \(66\) must be divisible by num_attention_heads \(4\)"):
        ModelConfig.from_hf_dict(edited(hidden_size=66, head_dim=...))


def test_accepted_spellings():
    """What real configs write: architectures as one string, integral floats, nulls for the
    optional sizes (their defaults apply)."""
    cfg = ModelConfig.from_hf_dict(edited(architectures="MistralForCausalLM", model_type=..., hidden_size=64.0,
                                          head_dim=None, num_key_value_heads=None, max_position_embeddings=None))
    assert cfg.model_type == "mistral"
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.max_position_embeddings) == (64, 16, 4, 2048)
    assert type(cfg.hidden_size) is int
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        ModelConfig.from_hf_dict(edited(architectures="GPT2LMHeadModel", model_type=...))


@pytest.mark.parametrize("value", [5, {"a": 1}, [1], ["LlamaForCausalLM", None]])
@pytest.mark.parametrize("model_type", ["llama", ...])
def test_architectures_must_be_a_list_of_names(value, model_type):
    with pytest.raises(UnsupportedModelError,
                       match="^" + re.escape(f"config.json: architectures must be a list of names, got {value!r}")):
        ModelConfig.from_hf_dict(edited(architectures=value, model_type=model_type))


def write_config(d, data) -> None:
    (d / "config.json").write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())


def test_loader_names_the_file_that_is_not_utf8(tmp_path):
    from kiln.runtime import loader

    write_config(tmp_path, b'{"model_type": "\xff"}')
    with pytest.raises(loader.ModelSourceError, match=f"cannot read {tmp_path / 'config.json'}: .*utf-8"):
        loader.load_hf_config_dict(loader.resolve_source(tmp_path))


def test_a_shape_only_builtin_asks_for_dummy_weights():
    from kiln.runtime import loader

    with pytest.raises(loader.ModelSourceError, match="builtin:llama-3.2-1b .*--load-format dummy"):
        next(loader.iter_weights(loader.resolve_source("builtin:llama-3.2-1b")))


def test_loader_refuses_a_config_that_is_not_an_object(tmp_path):
    from kiln.runtime import loader

    write_config(tmp_path, [1, 2])
    with pytest.raises(UnsupportedModelError, match="config.json: expected a JSON object, got list"):
        loader.load_model_config(loader.resolve_source(tmp_path))


@pytest.mark.parametrize("data, message", [
    ([1, 2], "config.json: expected a JSON object, got list"),
    (edited(num_attention_heads=0, head_dim=...), "config.json: num_attention_heads must be a positive integer, got 0"),
    (edited(hidden_size="big"), "config.json: hidden_size must be a positive integer, got 'big'"),
    (b'{"model_type": "\xff"}', "config.json: 'utf-8' codec can't decode"),
])
def test_kiln_build_exits_2_with_one_line(tmp_path, data, message):
    src, out = tmp_path / "model", tmp_path / "engine"
    src.mkdir()
    write_config(src, data)
    r = subprocess.run([sys.executable, "-m", "kiln.runtime.cli", "build", "--model", str(src), "--output", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0] == r.stderr.splitlines()[-1], r.stderr  # after the progress lines
    assert errors[0].startswith("kiln build: error: ") and message in errors[0], r.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["model"]
