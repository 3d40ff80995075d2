"""paged_attention (Triton) against paged_attention_ref (float64) on the CPU interpreter or GPU."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import ATTN_DTYPES, DEVICE, HAS_CUDA, assert_close, make_paged_kv, make_queries, poison, rel_err
from kiln.kernels import paged_attention, paged_attention_ref

GQA = [(4, 4), (8, 2), (8, 1)]  # (query heads, kv heads): ratios 1, 4, 8


def _run(q, k_cache, v_cache, table, seq_lens, cu, scale=None, k_scale=None, v_scale=None, **kw):
    D = q.shape[-1]
    scale = scale if scale is not None else D ** -0.5
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
    out = poison(torch.empty_like(q))
    res = paged_attention(q, k_cache, v_cache, table, sl, cu, scale, k_scale, v_scale, out=out, **kw)
    assert res is out
    # float64 q makes the reference compute in float64 (never copy the whole cache)
    ref = paged_attention_ref(q.double(), k_cache, v_cache, table, sl, cu, scale, k_scale, v_scale)
    return out, ref


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", GQA)
def test_decode(heads, block_size, dtype, splits):
    Hq, Hkv = heads
    seq_lens = [1, 17, 64, 45]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, 32, block_size, dtype)
    q, cu = make_queries([1] * len(seq_lens), Hq, 32, dtype)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=splits)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", GQA)
def test_mixed_prefill_and_decode(heads, block_size, dtype):
    """One batch: a decode, a chunk after a cached prefix, a whole prompt, a 1-token prompt."""
    Hq, Hkv = heads
    seq_lens = [33, 40, 7, 1]
    q_lens = [1, 19, 7, 1]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, 32, block_size, dtype)
    q, cu = make_queries(q_lens, Hq, 32, dtype)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu)
    assert_close(out, ref, dtype)


def test_prefill_with_context_splits():
    seq_lens, q_lens = [50, 21], [20, 21]
    k_cache, v_cache, table = make_paged_kv(seq_lens, 2, 32, 16, torch.float32)
    q, cu = make_queries(q_lens, 8, 32, torch.float32)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=2)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("head_dim", [40, 8])
@pytest.mark.parametrize("decode", [True, False])
def test_odd_head_dims(head_dim, decode):
    seq_lens = [23, 9]
    q_lens = [1, 1] if decode else [5, 9]
    k_cache, v_cache, table = make_paged_kv(seq_lens, 2, head_dim, 16, torch.float16)
    q, cu = make_queries(q_lens, 6, head_dim, torch.float16)  # 3 query heads per kv head
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=2 if decode else None)
    assert_close(out, ref, torch.float16)


def test_max_query_len_hint_and_auto_splits():
    """max_query_len=1 selects decode even when T != S would be ambiguous; auto split count."""
    seq_lens = [300, 5, 77]
    k_cache, v_cache, table = make_paged_kv(seq_lens, 1, 16, 16, torch.float16)
    q, cu = make_queries([1, 1, 1], 4, 16, torch.float16)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, max_query_len=1)
    assert_close(out, ref, torch.float16)


@pytest.mark.parametrize("decode", [True, False])
def test_large_block_ids_need_int64_offsets(decode):
    """Blocks past 2**31 elements into the pool: a 32-bit offset would wrap."""
    Hkv, D, bs = 1, 16, 16
    per_block = bs * Hkv * D
    num_blocks = 2**31 // per_block + 40  # the top 40 blocks start past 2**31 elements
    seq_lens = [70, 33] if decode else [40, 33]
    q_lens = [1, 1] if decode else [40, 3]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, D, bs, torch.float16, num_blocks=num_blocks, high_ids=True)
    assert int(table[:, 0].min()) * per_block > 2**31
    q, cu = make_queries(q_lens, 2, D, torch.float16)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=2 if decode else None)
    assert_close(out, ref, torch.float16)


# ---------------------------------------------------------------------------------------
def _fp8_scales(kind, Hkv):
    if kind == "none":
        return None, None
    if kind == "float":
        return 0.05, 0.02
    if kind == "tensor":
        return (torch.tensor([0.05], device=DEVICE), torch.tensor([0.02], device=DEVICE))
    return (torch.linspace(0.01, 0.1, Hkv, device=DEVICE), torch.linspace(0.1, 0.02, Hkv, device=DEVICE))


@pytest.mark.parametrize("words", [False, True])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "per_head"])
def test_fp8_cache(scale_kind, decode, words):
    Hq, Hkv, D = 8, 2, 64  # fp8_v_words needs head_dim >= 64 (at 32 the launcher falls back to bytes)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    seq_lens = [37, 20]
    q_lens = [1, 1] if decode else [6, 20]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, D, 16, torch.float32)
    k_cache = (k_cache * 8).to(torch.float8_e4m3fn)
    v_cache = (v_cache * 8).to(torch.float8_e4m3fn)
    ks, vs = _fp8_scales(scale_kind, Hkv)
    q, cu = make_queries(q_lens, Hq, D, dtype)
    cfg = {"fp8_v_words": words} if decode else {"fp8_v_words": words, "BLOCK_M": 16, "BLOCK_N": 16}
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, k_scale=ks, v_scale=vs,
                    num_splits=2 if decode else None, config=cfg)
    assert_close(out, ref, dtype, factor=2)


def test_padded_decode_slot_gives_zeros():
    seq_lens = [12, 0, 5]
    k_cache, v_cache, table = make_paged_kv([12, 1, 5], 2, 16, 16, torch.float32)
    q, cu = make_queries([1, 1, 1], 4, 16, torch.float32)
    for splits in (1, 2):
        out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=splits)
        assert torch.equal(out[1].cpu(), torch.zeros_like(out[1]).cpu())
        assert_close(out, ref, torch.float32)


def test_strided_query_view():
    """q as a view of a fused QKV projection output (token stride > Hq * D)."""
    Hq, Hkv, D = 4, 2, 16
    seq_lens, q_lens = [20, 9], [3, 9]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, D, 16, torch.float32)
    qkv = torch.randn(sum(q_lens), (Hq + 2 * Hkv) * D, device=DEVICE)
    q = qkv[:, : Hq * D].view(-1, Hq, D)
    assert not q.is_contiguous()
    _, cu = make_queries(q_lens, Hq, D, torch.float32)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu)
    assert_close(out, ref, torch.float32)


def test_rejects_bad_arguments():
    k_cache, v_cache, table = make_paged_kv([5], 2, 16, 16, torch.float32)
    q, cu = make_queries([1], 4, 16, torch.float32)
    sl = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], k_cache, v_cache, table, sl, cu, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, k_cache, v_cache, table.long(), sl, cu, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.half(), k_cache, v_cache, table, sl, cu, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :8].contiguous(), k_cache, v_cache, table, sl, cu, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        kx = torch.randn(*k_cache.shape[:3], 32, device=DEVICE)[..., ::2]
        paged_attention(q, kx, kx, table, sl, cu, 1.0)
    f8 = k_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="elements"):
        paged_attention(q, f8, f8, table, sl, cu, 1.0, torch.ones(3, device=DEVICE), None)


# ---------------------------------------------------------------------------------------
# Real sizes (GPU only): Llama-3-8B attention shapes, bf16.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_real_size(dtype):
    seq_lens = torch.randint(1, 4097, (64,)).tolist()
    seq_lens[0], seq_lens[1] = 4096, 1
    k_cache, v_cache, table = make_paged_kv(seq_lens, 8, 128, 16, dtype, extra_blocks=1000)
    q, cu = make_queries([1] * 64, 32, 128, dtype)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu)
    assert_close(out, ref, dtype)
    out1, _ = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=1)
    assert_close(out1, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_mixed_real_size(block_size):
    q_lens = [1, 512, 1, 1000, 37, 1, 2048]
    seq_lens = [3000, 512, 17, 2500, 37, 4096, 2048]
    dtype = torch.bfloat16
    k_cache, v_cache, table = make_paged_kv(seq_lens, 8, 128, block_size, dtype)
    q, cu = make_queries(q_lens, 32, 128, dtype)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
def test_gpu_large_block_ids_real_heads():
    Hkv, D, bs = 8, 128, 16
    num_blocks = 2**31 // (bs * Hkv * D) + 600  # ~4.3 GB per bf16 cache
    seq_lens, q_lens = [4000, 300, 1200], [1, 300, 64]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, D, bs, torch.bfloat16, num_blocks=num_blocks, high_ids=True)
    q, cu = make_queries(q_lens, 32, D, torch.bfloat16)
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu)
    assert_close(out, ref, torch.bfloat16)
    qd, cud = make_queries([1, 1, 1], 32, D, torch.bfloat16)
    out, ref = _run(qd, k_cache, v_cache, table, seq_lens, cud)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("words", [False, True])
@pytest.mark.parametrize("scale_kind", ["float", "per_head"])
def test_gpu_fp8_real_size(scale_kind, words):
    seq_lens = torch.randint(1, 2049, (32,)).tolist()
    k_cache, v_cache, table = make_paged_kv(seq_lens, 8, 128, 16, torch.float32)
    k_cache = (k_cache * 8).to(torch.float8_e4m3fn)
    v_cache = (v_cache * 8).to(torch.float8_e4m3fn)
    ks, vs = _fp8_scales(scale_kind, 8)
    q, cu = make_queries([1] * 32, 32, 128, torch.bfloat16)
    for splits in (None, 1):
        out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, k_scale=ks, v_scale=vs, num_splits=splits,
                        config={"fp8_v_words": words})
        assert_close(out, ref, torch.bfloat16, factor=2)
