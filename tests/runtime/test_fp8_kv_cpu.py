"""The CPU attention path over an fp8 KV cache dequantizes only the blocks the batch's block
tables cover, renumbered into a compact cache: same result as dequantizing the whole pool."""

from __future__ import annotations

import time

import torch

from kiln.runtime.attention import AttentionMetadata, torch_backend
from kiln.runtime.attention.backend import paged_attention


def _meta(seq_lens, q_lens, table, block_size):
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), seq_lens_list=list(seq_lens),
        query_lens_list=list(q_lens), block_size=block_size)


def test_fp8_cache_reads_only_the_used_blocks():
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, Hkv, Hq, D = 6000, 16, 2, 4, 32
    k_cache = (torch.randn(num_blocks, bs, Hkv, D, generator=g) * 50).to(torch.float8_e4m3fn)
    v_cache = (torch.randn(num_blocks, bs, Hkv, D, generator=g) * 50).to(torch.float8_e4m3fn)
    seq_lens, q_lens = [37, 5, 60], [1, 1, 12]  # two decodes and a prefill chunk
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((3, 8), 0, dtype=torch.int32)
    table[0, :3] = perm[:3]
    table[1, :1] = perm[2:3]  # a block shared with sequence 0 (prefix sharing)
    table[2, :4] = perm[3:7]
    table[0, 3:] = perm[-5:]  # garbage past the context: must not matter
    q = torch.randn(sum(q_lens), Hq, D, generator=g)
    k_scale = torch.tensor([0.02, 0.03]).view(Hkv, 1)
    v_scale = torch.tensor([0.01, 0.04]).view(Hkv, 1)
    meta = _meta(seq_lens, q_lens, table, bs)
    t0 = time.perf_counter()
    out = paged_attention(q, k_cache, v_cache, meta, D ** -0.5, k_scale, v_scale, use_kernels=False)
    compact_s = time.perf_counter() - t0
    full = torch_backend.paged_attention(q, k_cache.to(q.dtype) * k_scale, v_cache.to(q.dtype) * v_scale, meta,
                                         D ** -0.5)
    assert torch.equal(out, full)
    assert meta.block_tables is table and int(table[0, 0]) == int(perm[0])  # the caller's metadata is untouched
    print(f"compact path {compact_s * 1e3:.1f} ms")
