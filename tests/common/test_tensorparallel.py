"""The tensor-parallel rule shared by ``kiln serve`` and the operator (torch-free)."""

import pytest

from kiln.common.tensorparallel import ParallelShape, check_tensor_parallel, tensor_parallel_problem

LLAMA_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336}


def test_llama_splits_at_2_4_8_and_its_kv_heads_replicate_at_16():
    shape = ParallelShape.from_hf_config(LLAMA_8B)
    assert shape == ParallelShape(32, 8, 128, 14336)  # head_dim: hidden / heads
    assert [tp for tp in range(1, 33) if tensor_parallel_problem(shape, tp) is None] == [1, 2, 4, 8, 16, 32]
    assert "divide the KV heads or be a multiple of them" in tensor_parallel_problem(ParallelShape(12, 6, 64, 96), 4)
    assert tensor_parallel_problem(shape, 0) == "tensor parallel size must be at least 1, got 0"
    with pytest.raises(ValueError, match="runtime.tensorParallelSize 3 does not split the model's 32 attention"):
        check_tensor_parallel(shape, 3, "runtime.tensorParallelSize")


def test_int4_groups_come_from_the_manifest_and_bound_the_size():
    manifest = {"model": {"config": {**LLAMA_8B, "head_dim": 128}},
                "quantization": {"method": "int4-awq", "group_size": 128}}
    shape = ParallelShape.from_manifest(manifest)
    assert shape.int4_group_size == 128
    # down_proj: 14336 / 8 = 1792 = 14 x 128; o_proj 4096 / 32 = 128, but 14336 / 32 = 448 is not
    assert tensor_parallel_problem(shape, 8) is None
    assert "down_proj (14336 input features): each rank's 448 must be a multiple of the group size 128" in \
        tensor_parallel_problem(shape, 32)
    fp8 = ParallelShape.from_manifest({**manifest, "quantization": {"method": "fp8"}})
    assert fp8.int4_group_size is None and tensor_parallel_problem(fp8, 32) is None


def test_the_record_form_round_trips_and_refuses_anything_else():
    shape = ParallelShape(6, 2, 64, 1024, 64)
    assert ParallelShape.from_dict(shape.to_dict()) == shape
    assert "int4GroupSize" not in ParallelShape(6, 2, 64, 1024).to_dict()
    for bad in (None, "x", {**shape.to_dict(), "headDim": True}, {**shape.to_dict(), "numAttentionHeads": 0},
                {k: v for k, v in shape.to_dict().items() if k != "intermediateSize"}):
        assert ParallelShape.from_dict(bad) is None
    with pytest.raises(ValueError, match="lacks a usable"):
        ParallelShape.from_hf_config({"num_attention_heads": 4})
