"""The runtime's attention backend on a mixed batch: decode rows first through the decode
kernel, prefill chunks through the prefill kernel (``AttentionMetadata.num_decodes``), against
the float64 reference and against one unified launch."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import ATTN_DTYPES, DEVICE, assert_close, make_paged_kv, make_queries
from kiln.kernels import paged_attention_ref
from kiln.runtime.attention import AttentionMetadata
from kiln.runtime.attention.backend import paged_attention


def _meta(seq_lens, q_lens, table, block_size, num_decodes):
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    dev = table.device
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=dev),
        block_tables=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), seq_lens_list=list(seq_lens),
        query_lens_list=list(q_lens), block_size=block_size, num_decodes=num_decodes,
        prefill_query_start_loc=torch.tensor([x - num_decodes for x in qsl[num_decodes:]], dtype=torch.int32,
                                             device=dev) if num_decodes else None,
        max_decode_seq_len=max(seq_lens[:num_decodes]) if num_decodes else 0)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
def test_decodes_first_split_matches_reference(heads, dtype):
    Hq, Hkv = heads
    seq_lens = [40, 17, 70, 30, 20, 5]  # three decodes, then chunks of 9, 20 (whole prompt), 5
    q_lens = [1, 1, 1, 9, 20, 5]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, 32, 16, dtype)
    q, cu = make_queries(q_lens, Hq, 32, dtype)
    scale = 32 ** -0.5
    split = paged_attention(q, k_cache, v_cache, _meta(seq_lens, q_lens, table, 16, 3), scale, use_kernels=True)
    whole = paged_attention(q, k_cache, v_cache, _meta(seq_lens, q_lens, table, 16, 0), scale, use_kernels=True)
    ref = paged_attention_ref(q.double(), k_cache, v_cache, table,
                              torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), cu, scale)
    assert_close(split, ref, dtype)
    assert_close(whole, ref, dtype)
