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
# The CUDA-core decode kernel (decode_attention.py), selected with config={"kernel": "cuda_core"}.
# BLOCK_N / num_warps shape its tile [T, W, R] even on the interpreter (W = num_warps
# per-warp softmax states); prefetch 0/1/2 are its three loop variants.

CUDA_CORE = [{"kernel": "cuda_core", "BLOCK_N": 16, "num_warps": 1, "prefetch": 1},
             {"kernel": "cuda_core", "BLOCK_N": 32, "num_warps": 2, "prefetch": 2},
             {"kernel": "cuda_core", "BLOCK_N": 64, "num_warps": 2, "prefetch": 0}]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", GQA)
def test_decode_cuda_core(heads, block_size, splits):
    Hq, Hkv = heads
    seq_lens = [1, 17, 64, 45, 0, 130]  # an idle slot (0) gets zeros
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, 32, block_size, torch.float16)
    q, cu = make_queries([1] * len(seq_lens), Hq, 32, torch.float16)
    for cfg in CUDA_CORE:
        out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=splits, config=cfg, max_query_len=1)
        assert_close(out, ref, torch.float16)
        assert torch.equal(out[4].cpu(), torch.zeros_like(out[4]).cpu())


@pytest.mark.parametrize("scale_kind", ["float", "tensor", "per_head"])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_cuda_core_fp8(scale_kind, splits):
    Hq, Hkv, D = 16, 2, 64  # G = 8
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    seq_lens = [37, 20, 0, 70]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, D, 16, torch.float32)
    k_cache = (k_cache * 8).to(torch.float8_e4m3fn)
    v_cache = (v_cache * 8).to(torch.float8_e4m3fn)
    ks, vs = _fp8_scales(scale_kind, Hkv)
    q, cu = make_queries([1] * len(seq_lens), Hq, D, dtype)
    for cfg in CUDA_CORE[:2]:
        out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, k_scale=ks, v_scale=vs, num_splits=splits, config=cfg)
        assert_close(out, ref, dtype, factor=2)


@pytest.mark.parametrize("head_dim", [40, 8])
def test_decode_cuda_core_odd_head_dims(head_dim):
    seq_lens = [23, 9]
    k_cache, v_cache, table = make_paged_kv(seq_lens, 2, head_dim, 16, torch.float16)
    q, cu = make_queries([1, 1], 6, head_dim, torch.float16)  # G = 3 (padded to 4)
    for cfg in CUDA_CORE[:2]:
        out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=2, config=cfg)
        assert_close(out, ref, torch.float16)


def test_decode_cuda_core_large_block_ids():
    """Blocks past 2**31 elements into the pool: a 32-bit offset would wrap."""
    Hkv, D, bs = 1, 16, 16
    per_block = bs * Hkv * D
    num_blocks = 2**31 // per_block + 40
    seq_lens = [70, 33]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, D, bs, torch.float16, num_blocks=num_blocks, high_ids=True)
    assert int(table[:, 0].min()) * per_block > 2**31
    q, cu = make_queries([1, 1], 4, D, torch.float16)
    for cfg in CUDA_CORE[:2]:
        out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=2, config=cfg)
        assert_close(out, ref, torch.float16)


def test_decode_kernel_key():
    """tuning's "kernel" key is overridable per call; an unknown name is an error."""
    k_cache, v_cache, table = make_paged_kv([5], 2, 16, 16, torch.float32)
    q, cu = make_queries([1], 4, 16, torch.float32)
    with pytest.raises(ValueError, match="kernel"):
        _run(q, k_cache, v_cache, table, [5], cu, config={"kernel": "tensor"})
    out, ref = _run(q, k_cache, v_cache, table, [5], cu, config={"kernel": "mma"})
    assert_close(out, ref, torch.float32)


def _fp8_scales(kind, Hkv):
    if kind == "none":
        return None, None
    if kind == "float":
        return 0.05, 0.02
    if kind == "tensor":
        return (torch.tensor([0.05], device=DEVICE), torch.tensor([0.02], device=DEVICE))
    return (torch.linspace(0.01, 0.1, Hkv, device=DEVICE), torch.linspace(0.1, 0.02, Hkv, device=DEVICE))


@pytest.mark.parametrize("words", [0, 2, 3])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "per_head"])
def test_fp8_cache(scale_kind, decode, words):
    Hq, Hkv, D = 8, 2, 64  # fp8_words needs head_dim >= 64 (at 32 the launcher falls back to bytes)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    seq_lens = [37, 20]
    q_lens = [1, 1] if decode else [6, 20]
    k_cache, v_cache, table = make_paged_kv(seq_lens, Hkv, D, 16, torch.float32)
    k_cache = (k_cache * 8).to(torch.float8_e4m3fn)
    v_cache = (v_cache * 8).to(torch.float8_e4m3fn)
    ks, vs = _fp8_scales(scale_kind, Hkv)
    q, cu = make_queries(q_lens, Hq, D, dtype)
    cfg = {"fp8_words": words} if decode else {"fp8_words": words, "BLOCK_M": 16, "BLOCK_N": 16}
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, k_scale=ks, v_scale=vs,
                    num_splits=2 if decode else None, config=cfg)
    assert_close(out, ref, dtype, factor=2)


def test_fp8_words_out_of_range_is_refused():
    k_cache, v_cache, table = make_paged_kv([20], 2, 64, 16, torch.float32)
    k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    q, cu = make_queries([1], 8, 64, torch.float16)
    with pytest.raises(ValueError, match="fp8_words must be 0..3, got 4"):
        _run(q, k_cache, v_cache, table, [20], cu, k_scale=0.1, v_scale=0.1, config={"fp8_words": 4})


def test_padded_decode_slot_gives_zeros():
    seq_lens = [12, 0, 5]
    k_cache, v_cache, table = make_paged_kv([12, 1, 5], 2, 16, 16, torch.float32)
    q, cu = make_queries([1, 1, 1], 4, 16, torch.float32)
    for splits in (1, 2):
        out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=splits)
        assert torch.equal(out[1].cpu(), torch.zeros_like(out[1]).cpu())
        assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("heads", GQA)
def test_decode_fused_merge(heads, splits):
    """Decode splits merged by the last split of each KV head in the same launch: equal to the
    reference (contexts shorter than a split, an idle slot), equal to the two-launch merge up
    to float32 rounding, and the arrival counters are back at zero (a second call agrees)."""
    from kiln.kernels import attention
    from kiln.kernels.splitk import counters

    class NoMergeLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the fused path launched the merge kernel")

    two_launch = attention._merge_splits_kernel
    Hq, Hkv = heads
    seq_lens = [1, 40, 0, 64, 23]
    k_cache, v_cache, table = make_paged_kv([max(n, 1) for n in seq_lens], Hkv, 32, 16, torch.float32)
    q, cu = make_queries([1] * len(seq_lens), Hq, 32, torch.float32)
    attention._merge_splits_kernel = NoMergeLaunch()
    try:
        out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=splits, config={"fused_merge": True})
        again, _ = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=splits, config={"fused_merge": True})
    finally:
        attention._merge_splits_kernel = two_launch
    assert_close(out, ref, torch.float32)
    assert torch.equal(out[2].cpu(), torch.zeros_like(out[2]).cpu())  # the idle slot
    assert torch.equal(out, again)  # the counters were back at zero for the second launch
    assert int(counters(q.device, len(seq_lens) * Hkv)[: len(seq_lens) * Hkv].abs().sum()) == 0
    two, _ = _run(q, k_cache, v_cache, table, seq_lens, cu, num_splits=splits, config={"fused_merge": False})
    assert rel_err(out, two) < 1e-6


def test_decode_fused_merge_fp8_and_env_switch(monkeypatch):
    seq_lens = [33, 70]
    k_cache, v_cache, table = make_paged_kv(seq_lens, 2, 64, 16, torch.float32)
    k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    q, cu = make_queries([1, 1], 8, 64, torch.float16)
    kw = dict(k_scale=0.5, v_scale=0.25, num_splits=3)
    monkeypatch.setenv("KILN_ATTN_FUSED_MERGE", "1")
    out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, **kw)
    assert_close(out, ref, torch.float16)
    monkeypatch.setenv("KILN_ATTN_FUSED_MERGE", "yes")
    with pytest.raises(ValueError, match="KILN_ATTN_FUSED_MERGE must be 0 or 1"):
        _run(q, k_cache, v_cache, table, seq_lens, cu, **kw)


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
@pytest.mark.parametrize("words", [0, 1, 2, 3])
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
                        config={"fp8_words": words})
        assert_close(out, ref, torch.bfloat16, factor=2)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_decode_cuda_core_real_size(fp8):
    seq_lens = torch.randint(1, 4097, (64,)).tolist()
    seq_lens[0], seq_lens[1], seq_lens[2] = 4096, 1, 0
    k_cache, v_cache, table = make_paged_kv(seq_lens, 8, 128, 16, torch.float32 if fp8 else torch.bfloat16)
    ks = vs = None
    if fp8:
        k_cache, v_cache = (k_cache * 8).to(torch.float8_e4m3fn), (v_cache * 8).to(torch.float8_e4m3fn)
        ks, vs = _fp8_scales("per_head", 8)
    q, cu = make_queries([1] * 64, 32, 128, torch.bfloat16)
    for cfg in ({"BLOCK_N": 64, "num_warps": 4}, {"BLOCK_N": 32, "num_warps": 4, "prefetch": 2},
                {"BLOCK_N": 32, "num_warps": 1, "prefetch": 0}):
        for splits in (None, 1):
            out, ref = _run(q, k_cache, v_cache, table, seq_lens, cu, k_scale=ks, v_scale=vs, num_splits=splits,
                            config=dict(cfg, kernel="cuda_core"))
            assert_close(out, ref, torch.bfloat16, factor=2 if fp8 else 1)
