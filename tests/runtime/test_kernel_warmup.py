"""Start-up kernel warm-up: after ``LLMEngine`` starts on CUDA, serving compiles no Triton kernel.

On the CPU the warm-up is a no-op (the torch path has nothing to compile); the GPU test runs
through ``device`` (docs/benchmarks.md, session 9)."""

from __future__ import annotations

import json
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def _tiny(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": False, "eos_token_id": 2}))
    return d


def test_warmup_is_a_no_op_on_cpu(tmp_path):
    from kiln.runtime import LLM

    llm = LLM(model=str(_tiny(tmp_path)), load_format="dummy", device="cpu", num_kv_blocks=32)
    assert llm.engine.runner.warmup_kernels() == []


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (Triton compiles only for a GPU)")
@pytest.mark.parametrize("method", ["bf16", "int4"])
def test_no_triton_compile_while_serving(tmp_path, monkeypatch, method):
    from kiln.kernels.launch import record_compiles
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.model_runner import ModelRunner

    if method == "int4":
        from kiln.runtime.quantization.rtn import quantize_model_rtn

        orig = ModelRunner.init_dummy_weights

        def init(self, *a, **k):
            orig(self, *a, **k)
            quantize_model_rtn(self.model, "int4")

        monkeypatch.setattr(ModelRunner, "init_dummy_weights", init)
    llm = LLM(model=str(_tiny(tmp_path)), load_format="dummy", max_num_seqs=8, num_kv_blocks=256,
              max_model_len=512, max_num_batched_tokens=256)
    rng = random.Random(0)
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 30, 31, 32, 33, 47, 48, 63, 64, 65, 66, 100, 130, 200, 300]
    base = [rng.randrange(3, 500) for _ in range(300)]
    prompts = [base[:n] for n in lengths] + [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    rng.shuffle(prompts)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=4, ignore_eos=True, detokenize=False)
    with record_compiles() as compiled:
        outs = llm.generate(prompts, greedy)  # mixed prefill / decode steps, prefix hits, chunking
        for p in prompts[:6]:
            llm.generate([p], sampled)
        llm.generate(prompts[:3], SamplingParams(max_tokens=3, n=2, ignore_eos=True, detokenize=False, seed=1))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert compiled == [], f"kernels compiled while serving (warm-up missed them): {compiled}"


def test_warmup_forwards_write_nothing(tmp_path):
    """The synthetic warm-up steps run through the real forward (any backend) without touching
    the KV cache (every slot -1) and within the token budget and model length."""
    from kiln.runtime import LLM

    llm = LLM(model=str(_tiny(tmp_path)), load_format="dummy", device="cpu", num_kv_blocks=32, max_model_len=64)
    runner = llm.engine.runner
    steps = runner.warmup_steps(20, 64)
    assert steps and all(sum(q for _, q in r) <= 20 and max(c + q for c, q in r) <= 64 for r in steps)
    assert any(len(r) > 1 and r[0][1] == 1 and r[-1][1] > 1 for r in steps)  # a mixed decode + prefill step
    few = runner.warmup_steps(20, 64, max_num_seqs=1)  # a step of 2 sequences cannot happen then
    assert few and all(len(r) == 1 for r in few) and [r for r in steps if len(r) == 1] == few
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for rows in steps:
        runner._warmup_forward(rows)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv_caches, before))
