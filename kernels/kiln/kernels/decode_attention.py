"""Decode attention over the paged KV cache with CUDA-core dot products (small GQA groups).

The ``"cuda_core"`` decode kernel of ``attention.paged_attention`` (selected by the
``"kernel"`` key of ``tuning.ATTENTION["decode"]`` / ``["decode_fp8"]`` or by
``config={"kernel": "cuda_core"}``).  Same semantics, grid and partial-result layout as the
``"mma"`` decode mode of ``attention._paged_attn_kernel``: one program per (sequence, KV
head, context split), all G query heads of the KV head in the program, flash-decoding
splits merged by ``attention._merge_splits_kernel``.

Why: with G = 4 query rows the tensor-core path pads the group to 16 rows and, for a
float8_e4m3fn cache, converts the dot operands after a shared-memory round trip; on the
H200 it is then instruction-bound (as slow per token as a bf16 cache).  Here there is no
``tl.dot``: as in FlashInfer's CUDA-core decode kernel for small GQA groups (Ye et al.
2025) and vLLM's paged attention v1/v2, each thread loads 16-byte vectors of K and V rows,
converts them in registers to float32 and does the products with FMAs:

* tile = BLOCK_N tokens laid out as ``[R, W, T]`` (tokens ``start + (r * W + w) * T + t``)
  with the head dim last: ``T`` lanes of a warp per token row along the tokens, ``32 / T``
  lanes along the head dim with one 16-byte vector each, ``W = num_warps`` warps, ``R``
  rows in registers.  Shapes are 5-D ``[G, R, W, T, D]`` so that Triton's default
  (coalesced) layout is exactly that thread map and every op in the loop stays in it (no
  ``convert_layout``, no shared memory in the inner loop).
* ``s[g, n] = sum_d q[g, d] k[n, d]`` (the query pre-multiplied by ``scale * log2(e) *
  k_scale``): 16 in-thread FMAs per lane, then a butterfly over the ``32 / T`` lanes.
* online softmax in base 2 **per warp** (running max ``m[g, w]``, per-lane sums
  ``l[g, w, t]``), no cross-warp reduction in the loop; ``acc[g, w, t, d] += sum_r p * v``
  keeps the token sum of P @ V in-thread (no shuffles); lanes and warps are merged once
  after the loop (log-sum-exp merge, as the flash-decoding merge across splits).
* full tiles run without masks; the last, partial tile of a split is masked.

Per (token, KV head) with G = 4, D = 128, fp8: 2 x 4 x 128 FMAs = 32 warp-instructions
plus conversions (2 x 128 elements), the score butterfly and the softmax; see
``sass_count.py`` for the measured SASS counts.

Reference: ``reference.paged_attention_ref`` (decode rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_kwargs, pdl_start

__all__ = ["decode_layout", "paged_decode_cuda_core"]


@triton.jit
def _load_scale(ptr, stride, val, head, MODE: tl.constexpr):
    """A KV dequantization scale: MODE 0 none (1.0), 1 the float ``val``, 2 ``ptr[head * stride]``."""
    s = 1.0
    if MODE == 2:
        s = tl.load(ptr + head * stride).to(tl.float32)
    elif MODE == 1:
        s = val
    return s


@triton.jit
def _kv_offsets(bt_row, n, n_ok, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE: tl.constexpr):
    """int64 element offsets of tokens ``n`` ([1, T, W, R, 1]) in the K and V caches (block
    table entries of tokens with ``n_ok`` false read as block 0)."""
    blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    off = (n % BLOCK_SIZE).to(tl.int64)
    return blk * stride_kb + off * stride_kt, blk * stride_vb + off * stride_vt


@triton.jit
def _load_tile(ptr, n_ok, d_ok, MASK_D: tl.constexpr):
    """A K or V tile; rows with ``n_ok`` false are not loaded (undefined), padded head-dim
    columns (MASK_D) read as 0 (the query is 0 there, and 0 * NaN would poison the sum)."""
    if MASK_D:
        x = tl.load(ptr, mask=n_ok & d_ok, other=0.0)
    else:
        x = tl.load(ptr, mask=n_ok)
    return x


@triton.jit
def _decode_tile(q, m_i, l_i, acc, k, v, n_ok, MASKED: tl.constexpr):
    """Online-softmax update of the per-warp state with one tile of BLOCK_N tokens.

    q: f32 [G, 1, 1, 1, D] (scaled to log2 units); k, v: the tile as stored [1, T, W, R, D];
    m_i: [G, 1, W, 1, 1]; l_i: [G, T, W, 1, 1]; acc: [G, T, W, 1, D]; n_ok: [1, T, W, R, 1]
    (read only when MASKED: the last, partial tile of a split; its k, v are undefined there).
    """
    kf = k.to(tl.float32)
    vf = v.to(tl.float32)
    if MASKED:  # k, v are undefined (unloaded) past kv_hi: keep NaN patterns out
        kf = tl.where(n_ok, kf, 0.0)
        vf = tl.where(n_ok, vf, 0.0)
    s = tl.sum(q * kf, axis=4, keep_dims=True)  # [G, T, W, R, 1]
    if MASKED:
        s = tl.where(n_ok, s, float("-inf"))
    m_t = tl.max(tl.max(s, axis=3, keep_dims=True), axis=1, keep_dims=True)  # [G, 1, W, 1, 1] (per warp)
    m_new = tl.maximum(m_i, m_t)
    m_use = m_new
    if MASKED:  # a warp may see no valid token at all: keep exp2 arguments finite
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use)  # [G, T, W, R, 1]
    l_i = l_i * alpha + tl.sum(p, axis=3, keep_dims=True)
    acc = acc * alpha + tl.sum(p * vf, axis=3, keep_dims=True)  # [G, T, W, 1, D]
    return m_new, l_i, acc


@triton.jit
def _decode_cuda_core_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, cu_ptr,
    k_scale_ptr, k_scale_stride, k_scale_val, v_scale_ptr, v_scale_stride, v_scale_val,
    sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_pt, stride_ph,  # partials: row (t, h, split) = t * stride_pt + h * stride_ph + split
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,  # head dim; KV cache block size (tokens)
    G: tl.constexpr, G_P2: tl.constexpr,  # query heads per KV head, padded to a power of 2
    R: tl.constexpr, W: tl.constexpr, T: tl.constexpr,  # tile = R x W x T tokens (W = num_warps)
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PART_STRIDE: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr,
    PREFETCH: tl.constexpr,  # 0 none, 1 next tile's block-table entries, 2 also its K/V (registers)
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    s_id = tl.program_id(0)  # sequence; its one query row is cu[s_id]
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_N: tl.constexpr = R * W * T
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D

    g = tl.arange(0, G_P2)[:, None, None, None, None]  # [G, 1, 1, 1, 1]
    d = tl.arange(0, BLOCK_D)[None, None, None, None, :]  # [1, 1, 1, 1, D]
    d_ok = d < HEAD_DIM
    # token offsets in a tile, [1, T, W, R, 1]: Triton gives the lanes left over by the head dim
    # to the lowest-numbered dims, so T (lanes) comes first, W (warps) next, R (registers) last
    tok = ((tl.arange(0, R)[None, None, None, :, None] * W + tl.arange(0, W)[None, None, :, None, None]) * T
           + tl.arange(0, T)[None, :, None, None, None])
    g_ok = g < G
    head = kvh * G + g
    q_row = tl.load(cu_ptr + s_id)
    if tl.load(cu_ptr + s_id + 1) == q_row:  # no query row (decode batches have exactly one)
        return
    t64 = q_row.to(tl.int64)
    bt_row = block_tables_ptr + s_id.to(tl.int64) * stride_bt

    ctx = tl.load(seq_lens_ptr + s_id)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * per_split
        kv_hi = tl.maximum(tl.minimum(kv_lo + per_split, ctx), kv_lo)  # empty past the context
    else:
        kv_lo = 0
        kv_hi = ctx

    k_scale = _load_scale(k_scale_ptr, k_scale_stride, k_scale_val, kvh, K_SCALE_MODE)
    v_scale = _load_scale(v_scale_ptr, v_scale_stride, v_scale_val, kvh, V_SCALE_MODE)
    qk_scale = sm_scale * 1.4426950408889634 * k_scale  # base-2 softmax, K scale folded in
    q = tl.load(q_ptr + t64 * stride_qt + head * stride_qh + d, mask=g_ok & d_ok, other=0.0)
    q = q.to(tl.float32) * qk_scale  # [G, 1, 1, 1, D]

    m_i = tl.full([G_P2, 1, W, 1, 1], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_P2, T, W, 1, 1], dtype=tl.float32)
    acc = tl.zeros([G_P2, T, W, 1, BLOCK_D], dtype=tl.float32)
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh

    num_full = (kv_hi - kv_lo) // BLOCK_N
    full_hi = kv_lo + num_full * BLOCK_N
    # software pipeline in registers (Triton's pipeliner does not prefetch loads that feed no
    # dot).  PREFETCH 1: the block-table entries (K/V offsets) of tile i+1 are loaded during
    # tile i, so the K/V loads of a tile do not wait for a dependent block-table load.
    # PREFETCH 2: also tile i+1's K/V data (more registers; fp8 tiles carried across the loop
    # cost byte permutes, see sass_count.py).
    n = kv_lo + tok
    k_off, v_off = _kv_offsets(bt_row, n, n < kv_hi, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
    if PREFETCH >= 2:
        k = _load_tile(k_head + k_off + d, n < kv_hi, d_ok, MASK_D)  # [1, T, W, R, D]
        v = _load_tile(v_head + v_off + d, n < kv_hi, d_ok, MASK_D)
        n1 = n + BLOCK_N
        k_off, v_off = _kv_offsets(bt_row, n1, n1 < kv_hi, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
        for start in range(kv_lo, full_hi, BLOCK_N):
            n1 = start + BLOCK_N + tok
            n1_ok = n1 < kv_hi
            k_next = _load_tile(k_head + k_off + d, n1_ok, d_ok, MASK_D)
            v_next = _load_tile(v_head + v_off + d, n1_ok, d_ok, MASK_D)
            n2 = n1 + BLOCK_N
            k_off, v_off = _kv_offsets(bt_row, n2, n2 < kv_hi, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
            m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, k, v, n1_ok, False)
            k = k_next
            v = v_next
    else:
        for start in range(kv_lo, full_hi, BLOCK_N):
            k = _load_tile(k_head + k_off + d, tok >= 0, d_ok, MASK_D)
            v = _load_tile(v_head + v_off + d, tok >= 0, d_ok, MASK_D)
            if PREFETCH == 1:
                n1 = start + BLOCK_N + tok
                k_off, v_off = _kv_offsets(bt_row, n1, n1 < kv_hi, stride_kb, stride_kt, stride_vb, stride_vt,
                                           BLOCK_SIZE)
            m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, k, v, tok >= 0, False)
            if PREFETCH == 0:
                n1 = start + BLOCK_N + tok
                k_off, v_off = _kv_offsets(bt_row, n1, n1 < kv_hi, stride_kb, stride_kt, stride_vb, stride_vt,
                                           BLOCK_SIZE)
        n_last = full_hi + tok
        k = _load_tile(k_head + k_off + d, n_last < kv_hi, d_ok, MASK_D)
        v = _load_tile(v_head + v_off + d, n_last < kv_hi, d_ok, MASK_D)
    if full_hi < kv_hi:  # the partial last tile (undefined past kv_hi)
        m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, k, v, full_hi + tok < kv_hi, True)

    # merge the per-warp, per-lane states (log-sum-exp, once per program)
    m = tl.max(m_i, axis=2, keep_dims=True)  # [G, 1, 1, 1, 1]
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(m_i - m_safe)  # [G, 1, W, 1, 1]; 0 for a warp that saw no token
    l = tl.sum(tl.sum(l_i * w, axis=1, keep_dims=True), axis=2, keep_dims=True)  # [G, 1, 1, 1, 1]
    o = tl.sum(tl.sum(acc * w, axis=1, keep_dims=True), axis=2, keep_dims=True) * v_scale  # [G, 1, 1, 1, D]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l == 0.0, 1.0, l)
        tl.store(out_ptr + t64 * stride_ot + head * stride_oh + d, (o / l_safe).to(out_ptr.dtype.element_ty),
                 mask=g_ok & d_ok)
    else:
        prow = (t64 * stride_pt + head * stride_ph + split) * PART_STRIDE  # [G, 1, 1, 1, 1]
        tl.store(part_m_ptr + prow, m, mask=g_ok)
        tl.store(part_l_ptr + prow, l, mask=g_ok)
        tl.store(part_acc_ptr + prow + d, o, mask=g_ok)


def decode_layout(dtype: torch.dtype, block_d: int, block_n: int, num_warps: int) -> tuple[int, int, int]:
    """``(R, W, T)`` of a tile: ``T`` token rows per warp so that ``32 / T`` lanes of one
    16-byte vector each span the (padded) head dim, ``W = num_warps``, ``R = block_n / (W T)``
    rows per thread (at least 1; the tile is ``R * W * T`` tokens)."""
    vec = max(1, min(16 // torch.empty((), dtype=dtype).element_size(), block_d))
    lanes_d = max(1, min(32, block_d // vec))
    T = max(1, 32 // lanes_d)
    W = max(1, int(num_warps))
    R = triton.next_power_of_2(max(1, block_n // (W * T)))
    return R, W, T


def paged_decode_cuda_core(
    q, k_cache, v_cache, out, part_acc, part_m, part_l, block_tables, seq_lens, cu_seqlens_q,
    ks, vs, scale: float, splits: int, block_d: int, part_stride: int, cfg: dict,
) -> None:
    """Launch the CUDA-core decode kernel; arguments are checked by ``attention.paged_attention``.

    q/out: ``[T, Hq, D]`` (sequence ``s`` owns query row ``cu_seqlens_q[s]``); caches ``[num_blocks, block_size,
    Hkv, D]``; ``ks``/``vs``: ``launch.scale_args`` tuples; with ``splits > 1`` the partial
    rows go to ``part_acc/part_m/part_l`` (``attention`` merges them).  ``cfg``:
    ``BLOCK_N``, ``num_warps``, ``num_stages``, optional ``prefetch`` (0/1/2, default 1) and
    ``maxnreg`` (register cap per thread, for occupancy).
    """
    _, Hq, D = q.shape
    S = seq_lens.shape[0]
    _, block_size, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    R, W, T = decode_layout(k_cache.dtype, block_d, cfg["BLOCK_N"], cfg["num_warps"])
    extra = {"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {}
    _decode_cuda_core_kernel[(S, Hkv, splits)](
        q, k_cache, v_cache, out,
        part_acc, part_m, part_l,
        block_tables, seq_lens, cu_seqlens_q,
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        Hq * splits, splits,
        HEAD_DIM=D, BLOCK_SIZE=block_size, G=G, G_P2=triton.next_power_of_2(G),
        R=R, W=W, T=T, BLOCK_D=block_d, NUM_SPLITS=splits, PART_STRIDE=part_stride,
        K_SCALE_MODE=ks[3], V_SCALE_MODE=vs[3], PREFETCH=int(cfg.get("prefetch", 1)),
        num_warps=W, num_stages=cfg.get("num_stages", 2), **extra, **launch_kwargs(q.device),
    )
