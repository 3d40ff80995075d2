"""Fixtures for the engine-build tests: a tiny random Llama in a Hugging Face folder (with
SmolLM2's tokenizer) so that every method builds in seconds, and the embedded SmolLM2 for the
accuracy gates (marked slow)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("KILN_CPU_THREADS", "1")  # the CI machine's 2 cores are shared

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}


def make_tiny_llama(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a 2-layer random Llama (HF names, float32) with a few outlier input channels."""
    import torch
    from safetensors.torch import save_file

    c = TINY_CONFIG
    g = torch.Generator().manual_seed(seed)
    H, I, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D

    def rnd(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": rnd(c["vocab_size"], H, std=0.5), "model.norm.weight": torch.ones(H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        ln = torch.ones(H)
        ln[:3] = 8.0  # outlier channels, as real LLMs have
        t |= {p + "input_layernorm.weight": ln, p + "post_attention_layernorm.weight": ln.clone(),
              p + "self_attn.q_proj.weight": rnd(q, H, std=0.2), p + "self_attn.k_proj.weight": rnd(kv, H, std=0.2),
              p + "self_attn.v_proj.weight": rnd(kv, H), p + "self_attn.o_proj.weight": rnd(H, q),
              p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
              p + "mlp.down_proj.weight": rnd(H, I)}
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, path / f)
    return path


@pytest.fixture(scope="session")
def smollm_hf():
    """The embedded SmolLM2 as a Hugging Face folder (converted once from its GGUF)."""
    from kiln.runtime import loader

    return loader.materialize_gguf(loader.resolve_source(None))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm_hf) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", Path(smollm_hf.path))


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory, tiny_model):
    """One engine per method, built once: {name: path}."""
    from kiln.runtime.build import build_engine
    from kiln.common.enginespec import BuildSpec

    root = tmp_path_factory.mktemp("engines")
    specs = {
        "none": dict(),
        "fp8": dict(quantization="fp8"),
        "int8-smoothquant": dict(quantization="int8-smoothquant"),
        "int4-awq": dict(quantization="int4-awq", group_size=32),
        "int4-gptq": dict(quantization="int4-gptq", group_size=32),
        "kv-fp8": dict(kv_cache_dtype="fp8"),
        "int4-awq-lm-head": dict(quantization="int4-awq", group_size=32, quantize_lm_head=True),
        "int4-gptq-lm-head": dict(quantization="int4-gptq", group_size=32, quantize_lm_head=True),
    }
    out = {}
    for name, kw in specs.items():
        spec = BuildSpec.from_cli(str(tiny_model), calibration_samples=4, **kw)
        out[name] = build_engine(spec, str(tiny_model), root / name, device="cpu").path
    return out
