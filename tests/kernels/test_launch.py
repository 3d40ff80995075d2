"""Launch heuristics in ``kiln.kernels.launch`` (host-only; the numbers behind them are in
``tuning.py`` and docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import tuning
from kiln.kernels.launch import decode_num_splits

CPU = torch.device("cpu")  # counts as tuning.DEFAULT_NUM_SMS (132, the H200) SMs


@pytest.fixture(autouse=True)
def _gpu_rules(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the interpreter caps splits at 2


def test_one_split_once_the_grid_fills_the_gpu():
    # 384 x 8 = 3072 programs >= 8 per SM: splitting only adds partials and a merge
    assert decode_num_splits(384, 8, CPU) == 1
    assert decode_num_splits(256, 8, CPU) == 1
    threshold = tuning.DEFAULT_NUM_SMS * tuning.DECODE_SPLIT["single_split_programs_per_sm"]
    assert decode_num_splits(threshold // 8, 8, CPU) == 1
    assert decode_num_splits(threshold // 8 - 1, 8, CPU) >= 2


def test_small_batches_split_the_context():
    assert decode_num_splits(64, 8, CPU) == 2  # B64 ctx4096: 1 split 71%, 2 splits 96-99.9% of copy BW
    assert decode_num_splits(1, 8, CPU) == tuning.DECODE_SPLIT["max_splits"]
    assert decode_num_splits(1, 8, CPU, max_context=256) == 2  # no split under 128 tokens


def test_kernel_options_are_checked_and_typed():
    """``KernelOptions``: booleans and a dequantization threshold >= 1, refused otherwise (the
    engine builds them once from ``EngineArgs``)."""
    import pytest

    from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions

    assert DEFAULT_OPTIONS == KernelOptions(pdl=True, fused_rope_kv=True, w4a16_dequant_min_m=65)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="w4a16_dequant_min_m must be an integer >= 1"):
            KernelOptions(w4a16_dequant_min_m=bad)
    with pytest.raises(ValueError, match="pdl must be a bool"):
        KernelOptions(pdl="0")
    assert KernelOptions(w4a16_dequant_min_m=128).w4a16_dequant_min_m == 128
