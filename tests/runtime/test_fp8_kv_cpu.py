"""The CPU attention path over an fp8 KV cache dequantizes only the blocks the batch's block
tables cover, renumbered into a compact cache: same result as dequantizing the whole pool."""

from __future__ import annotations

import time

import torch

from kiln.kernels.reference import paged_attention_ref
from kiln.runtime.attention import AttentionMetadata
from kiln.runtime.attention.backend import paged_attention


def _full(q, k_cache, v_cache, meta, scale):
    """The torch reference over the whole (dequantized) pool."""
    return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)


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
    full = _full(q, k_cache.to(q.dtype) * k_scale, v_cache.to(q.dtype) * v_scale, meta,
                                         D ** -0.5)
    assert torch.equal(out, full)
    assert meta.block_tables is table and int(table[0, 0]) == int(perm[0])  # the caller's metadata is untouched
    print(f"compact path {compact_s * 1e3:.1f} ms")


def test_compact_blocks_computed_once_per_metadata(monkeypatch):
    """Which blocks a step reads and its renumbered block tables depend on the metadata only:
    the first layer computes them, the other layers reuse them (each dequantizes its own
    cache, bit-identical to dequantizing the whole pool); a new step's metadata, or a
    replaced block table, gets them computed afresh."""
    from kiln.runtime.attention import backend

    calls = []
    real = backend._compact_blocks

    def counting(meta, *args):
        calls.append(meta)
        return real(meta, *args)

    monkeypatch.setattr(backend, "_compact_blocks", counting)
    g = torch.Generator().manual_seed(1)
    num_layers, num_blocks, bs, Hkv, Hq, D = 3, 64, 4, 2, 4, 16
    caches = [tuple((torch.randn(num_blocks, bs, Hkv, D, generator=g) * 50).to(torch.float8_e4m3fn)
                    for _ in range(2)) for _ in range(num_layers)]
    k_scale = torch.tensor([0.02, 0.03]).view(Hkv, 1)
    v_scale = torch.tensor([0.01, 0.04]).view(Hkv, 1)
    seq_lens, q_lens = [9, 3, 14], [1, 1, 5]
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros((3, 6), dtype=torch.int32)
    table[0, :3] = perm[:3]
    table[1, :1] = perm[1:2]  # shared with sequence 0
    table[2, :4] = perm[3:7]
    table[0, 3:] = perm[-3:]  # past the context
    meta = _meta(seq_lens, q_lens, table, bs)
    q = torch.randn(sum(q_lens), Hq, D, generator=g)
    for k_cache, v_cache in caches:  # one forward: every layer gets the same metadata
        out = paged_attention(q, k_cache, v_cache, meta, D ** -0.5, k_scale, v_scale, use_kernels=False)
        full = _full(q, k_cache.to(q.dtype) * k_scale, v_cache.to(q.dtype) * v_scale,
                                             meta, D ** -0.5)
        assert torch.equal(out, full)
    assert len(calls) == 1 and calls[0] is meta
    cached = backend._step_compact_blocks(meta, caches[0][0])
    fresh = real(meta, num_blocks, bs, torch.device("cpu"))
    assert torch.equal(cached.used, fresh.used) and torch.equal(cached.meta.block_tables, fresh.meta.block_tables)
    assert cached.meta.block_tables.dtype == table.dtype and cached.key == fresh.key
    assert cached.used.tolist() == sorted(set(perm[:7].tolist()))
    assert meta.block_tables is table and torch.equal(table[0, 3:], perm[-3:].to(torch.int32))

    # the next step: a new metadata object (same layout) is computed afresh, never served the old one
    nxt = _meta(seq_lens, q_lens, table.clone(), bs)
    paged_attention(q, *caches[0], nxt, D ** -0.5, k_scale, v_scale, use_kernels=False)
    assert len(calls) == 2 and calls[-1] is nxt
    assert backend._step_compact_blocks(nxt, caches[0][0]) is not cached
    # a metadata object whose block table is replaced in place of a new object: computed afresh
    table2 = table.clone()
    table2[2, :4] = perm[10:14]
    meta.block_tables = table2
    out = paged_attention(q, *caches[1], meta, D ** -0.5, k_scale, v_scale, use_kernels=False)
    assert len(calls) == 3
    full = _full(q, caches[1][0].to(q.dtype) * k_scale, caches[1][1].to(q.dtype) * v_scale,
                                         meta, D ** -0.5)
    assert torch.equal(out, full)
