"""Decode CUDA-graph batch sizes (``model_runner.decode_graph_sizes``): no torch device needed."""

import pytest

from kiln.runtime.model_runner import SLOW_GEMM_BATCH_SIZES, decode_graph_sizes


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 7, 16, 17, 64, 255, 256, 384, 400, 448, 512, 1000])
def test_sizes_cover_every_batch(max_num_seqs):
    sizes = decode_graph_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes))
    assert sizes[-1] >= max_num_seqs
    assert not SLOW_GEMM_BATCH_SIZES & set(sizes)
    for n in range(1, max_num_seqs + 1):  # every running batch has a bucket, padded by < 48 rows
        b = next(s for s in sizes if s >= n)
        assert b - n < 48


def test_small_batches_are_exact_powers_then_multiples_of_16():
    assert decode_graph_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_graph_sizes(5) == [1, 2, 4, 5]
