"""Pre-quantized checkpoints served straight from their folder (``kiln serve --model``) at
tensor-parallel size 2 on the CPU: each linear's tensors are unpacked and (int4) repacked
whole, then cut to the rank's slice as an engine's are, so TP = 2 gives TP = 1's greedy
tokens.  The checkpoints are llm-compressor's own, of a tiny random Llama (hidden 128,
intermediate 256, 4 heads of 32: at TP = 2 each rank's 64 o_proj inputs hold whole groups of
64 and whole 64-column packed blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llmcompressor")

import prequant_producers as producers  # noqa: E402
from conftest import TINY_CONFIG, make_tiny_llama  # noqa: E402

PREQ_CONFIG = dict(TINY_CONFIG, hidden_size=128, intermediate_size=256, head_dim=32)


@pytest.fixture(scope="module")
def base(tmp_path_factory, smollm_hf) -> Path:
    saved = dict(TINY_CONFIG)
    TINY_CONFIG.update(PREQ_CONFIG)
    try:
        return make_tiny_llama(tmp_path_factory.mktemp("preq-tp") / "base", Path(smollm_hf.path), seed=3)
    finally:
        TINY_CONFIG.clear()
        TINY_CONFIG.update(saved)


def _greedy(model: str, tp: int) -> list[list[int]]:
    from kiln.runtime import LLM, SamplingParams

    prompts = [[1, 504, 9000, 3301, 100, 7, 42, 4242, 77, 1234, 18, 6], list(range(300, 340)), [5, 6, 7]]
    llm = LLM(model=model, tensor_parallel_size=tp, device="cpu", dtype="float32", num_kv_blocks=32,
              max_num_batched_tokens=32, max_model_len=256, cpu_threads=1)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.runner.close()


@pytest.mark.parametrize("scheme, group_size", [("W4A16", 64), ("FP8_DYNAMIC", None), ("W8A8", None)])
def test_prequantized_checkpoint_at_tp2_matches_tp1(base, tmp_path, scheme, group_size):
    ckpt = producers.llmcompressor_checkpoint(base, tmp_path / scheme, scheme, group_size=group_size)
    ref = _greedy(str(ckpt), 1)
    assert _greedy(str(ckpt), 2) == ref
    assert len(set(map(tuple, ref))) > 1  # the prompts' continuations differ: a real model, not a constant


def test_int4_groups_a_rank_would_cut_are_refused_before_loading(base, tmp_path):
    """W4A16 with llm-compressor's group 128 at TP = 2: each rank would hold 64 of o_proj's 128
    inputs, half a group: one line naming the layer and the sizes, before any worker starts."""
    import multiprocessing

    from kiln.runtime import LLM

    ckpt = producers.llmcompressor_checkpoint(base, tmp_path / "W4A16", "W4A16")
    with pytest.raises(ValueError, match=r"tensor parallel size 2 does not split the int4 engine's o_proj \(128 input "
                                         r"features\): each rank's 64 must be a multiple of the group size 128"):
        LLM(model=str(ckpt), tensor_parallel_size=2, device="cpu", dtype="float32")
    assert not multiprocessing.active_children()
