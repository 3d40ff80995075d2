"""Accuracy gates on the embedded default (SmolLM2-135M-Instruct from its GGUF, float32
baseline): perplexity on the shipped held-out text, each method against the baseline.

The issue's gates (docs/benchmarks.md, "Quantization", full text, 32 calibration samples) are
fp8 +1%, int8-smoothquant +3%, int4 +8%, fp8 KV +1%.  These CPU tests use less text and
calibration (so they fit a shared 2-core machine) and guard looser bounds.  Measured here
(2026-11-30, 1,024 tokens, 8 samples): fp8 +1.28%, int8-smoothquant +1.35%, int4-awq g64
+8.97%, int4-gptq g64 +11.34% (8 samples give GPTQ rank-deficient Hessians for the 1,536-wide
down projection; without true-sequential calibration it measured about +12.2%), fp8 KV +0.63%;
2026-12-01: int4-gptq g32 with the LM head quantized (``--quantize-lm-head``) +7.70%.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

EVAL_TOKENS = 1024
SAMPLES = 8
BOUNDS = {  # relative perplexity increase allowed here
    "fp8": 0.025,
    "int8-smoothquant": 0.03,
    "int4-awq": 0.12,
    "int4-gptq": 0.12,
    "kv-fp8": 0.015,
    "int4-gptq-lm-head": 0.12,
}
SPECS = {
    "fp8": dict(quantization="fp8"),
    "int8-smoothquant": dict(quantization="int8-smoothquant"),
    "int4-awq": dict(quantization="int4-awq", group_size=64),
    "int4-gptq": dict(quantization="int4-gptq", group_size=64),
    "kv-fp8": dict(kv_cache_dtype="fp8"),
    # the LM head quantized too (GPTQ: +0.65% for the head alone on the full text, AWQ +3.7%)
    "int4-gptq-lm-head": dict(quantization="int4-gptq", group_size=32, quantize_lm_head=True),
}


@pytest.fixture(scope="module")
def baseline():
    from kiln.runtime.eval import perplexity

    return perplexity(model="builtin:smollm2-135m-instruct", max_tokens=EVAL_TOKENS)


@pytest.mark.parametrize("name", list(SPECS))
def test_perplexity_gate(name, baseline, tmp_path):
    from kiln.runtime.build import build_engine
    from kiln.common.enginespec import BuildSpec
    from kiln.runtime.eval import perplexity

    from kiln.common.enginespec import CalibrationRef
    from kiln.runtime.quantization.calibration_data import data_path, sha256_of

    src = "builtin:smollm2-135m-instruct"
    # the docstring text these bounds were measured with (in-domain: the held-out text is docstrings
    # too); the default mixture and the other domains: docs/benchmarks.md, "Accuracy per domain"
    docs = data_path("calibration.txt")
    cal = CalibrationRef(kind="path", path=str(docs), checksum=sha256_of(docs))
    spec = BuildSpec.from_cli(src, calibration_samples=SAMPLES, calibration=cal, **SPECS[name])
    eng = build_engine(spec, src, tmp_path / spec.hash(), device="cpu").path
    got = perplexity(engine=str(eng), max_tokens=EVAL_TOKENS)
    assert got.num_tokens == baseline.num_tokens
    rise = got.perplexity / baseline.perplexity - 1
    print(f"{name}: perplexity {got.perplexity:.3f} vs {baseline.perplexity:.3f} ({rise:+.2%}, bound +{BOUNDS[name]:.1%})")
    assert rise < BOUNDS[name], f"{name}: perplexity {got.perplexity:.3f} vs {baseline.perplexity:.3f} (+{rise:.2%})"


def test_default_group_size_does_not_fit_smollm2(tmp_path):
    """SmolLM2-135M's hidden size 576 is not a multiple of 128: int4 needs --group-size 64/32."""
    from kiln.runtime.build import BadInputError, build_engine
    from kiln.common.enginespec import BuildSpec

    spec = BuildSpec.from_cli("builtin:smollm2-135m-instruct", quantization="int4-awq")
    with pytest.raises(BadInputError, match=r"group size 128 does not divide .* \[32, 64\]"):
        build_engine(spec, "builtin:smollm2-135m-instruct", tmp_path / "e", device="cpu")
    assert not (tmp_path / "e").exists()
