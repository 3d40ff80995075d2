"""W4A16 GEMV over K-major packed weights (``KERNEL: "gemvt"``), M = 1..4.

The packed int4 format (``w4a16``'s docstring) is ``qweight`` int32 ``[K // 8, N]``: stored
N-major (the checkpoint layout), one int32 per (packed row, column), so a GEMV program that
owns a few columns reads, per step, short runs of ``4 BLOCK_N`` bytes that lie ``4 N`` bytes
apart, and one that owns many columns needs many K splits (and their reduction tail) to fill
the GPU.  Stored K-major instead (``qweight.t().contiguous().t()``: the same ``[K // 8, N]``
tensor with strides ``(1, K // 8)``; ``w4a16.to_kmajor``), the eight packed rows of a 64-column
block of one output column are 32 contiguous bytes and a whole column is ``K / 2`` contiguous
bytes: the layout of a row-major bf16 weight, at a quarter of its size.  This kernel is then
``kiln.kernels.gemv``'s plan (the bf16 GEMV that streams Llama-3.1-8B's weights at 3.3-4.5 TB/s
on an H200) with the packed-half arithmetic of ``w4a16._gemv2_kernel``:

* a program owns ``BLOCK_N`` output columns (rows of W) and walks K in ``BLOCK_K``-wide steps;
  tile element ``(n, rb)`` is one 64-column block of one column: two 16-byte loads (packed
  rows 0..3 and 4..7), cut into words in registers with reshape / split (no shared memory);
* each word becomes four float16 pairs ``((q_t - z) / 16, (q_{t+4} - z) / 16)`` with one
  shift, four LOP3 and four HFMA2 (``w4a16._h2_dequant``; the zero point is folded in), then
  one HFMA2 per pair and row of x into a float16 chain of 32 products per lane (one block),
  which is added, times the group's scale, into float32 (``w4a16._h2_flush``);
* x is read as int64 words and paired to the lanes' K order once per block and thread
  (``w4a16._x_pairs``), shared by the thread's columns;
* rows past N are clamped to the last row (loads stay in bounds without a column mask) and
  dropped at the store; ``SPLIT_K`` > 1 splits K with the in-launch, split-ordered reduction
  of ``kiln.kernels.splitk``.

The weight stream is thus one long contiguous run per program (``BLOCK_N * K / 2`` bytes), as
in the pure-read floor that ``gpu_bench.bench_read_floor`` measures.  Precision is that of
``gemv2`` (float16 products and 32-long float16 chains: relative error ~1e-3; |x| < 65504).
Without ``ASM`` (the CPU interpreter) the same words are computed with integer and float32 ops.
Any strides work (the N-major tensor too, slowly); the launch choices in ``w4a16.TUNED_KMAJOR``
assume K-major.  The approach (row-major weights, threads along K, a cross-thread reduction at
the end) is the classic GEMV of FasterTransformer's and TensorRT-LLM's batch-1 weight-only
kernels; the code is Kiln's own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_start
from .w4a16 import _finish, _h2_dequant, _h2_flush4, _h2_fma, _h2_group, _h2_mul, _h2_rows_out, _ld, _x_pairs


@triton.jit
def _words4(w, D0: tl.constexpr, D1: tl.constexpr):
    """The four int32 words along the last axis (size 4, held by one thread) of ``w``
    ``[D0, D1, 4]`` as four tensors ``[D0, D1]`` (register moves, no shared memory)."""
    lo, hi = tl.split(tl.reshape(w, (D0, D1, 2, 2)))  # lo: words 0, 2; hi: words 1, 3
    w0, w2 = tl.split(lo)
    w1, w3 = tl.split(hi)
    return w0, w1, w2, w3


@triton.jit
def _x_half(xr, mk, jp: tl.constexpr, X_BF16: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """x pairs for packed rows ``4 jp .. 4 jp + 3`` of one 64-column block, as 1-D ``[RB]``
    tensors (one value per block: computed once per thread and block, then broadcast over the
    thread's columns).  ``xr`` [RB]: the block's first int64 word of x (word ``2 i + jp`` holds
    block columns ``8 i + 4 jp .. + 3``).  Returns ``(e, o)`` for rows ``4 jp`` / ``4 jp + 1``
    (``e[t]``, ``o[t]``: the float16 words ``(x[8 t + r], x[8 t + 32 + r])``) and the same for
    rows ``4 jp + 2`` / ``4 jp + 3``."""
    v0 = _ld(xr + jp, mk, 0, EVEN)
    v1 = _ld(xr + 2 + jp, mk, 0, EVEN)
    v2 = _ld(xr + 4 + jp, mk, 0, EVEN)
    v3 = _ld(xr + 6 + jp, mk, 0, EVEN)
    v4 = _ld(xr + 8 + jp, mk, 0, EVEN)
    v5 = _ld(xr + 10 + jp, mk, 0, EVEN)
    v6 = _ld(xr + 12 + jp, mk, 0, EVEN)
    v7 = _ld(xr + 14 + jp, mk, 0, EVEN)
    e0, o0 = _x_pairs(v0.to(tl.int32), v4.to(tl.int32), X_BF16, ASM)
    e1, o1 = _x_pairs(v1.to(tl.int32), v5.to(tl.int32), X_BF16, ASM)
    e2, o2 = _x_pairs(v2.to(tl.int32), v6.to(tl.int32), X_BF16, ASM)
    e3, o3 = _x_pairs(v3.to(tl.int32), v7.to(tl.int32), X_BF16, ASM)
    f0, p0 = _x_pairs((v0 >> 32).to(tl.int32), (v4 >> 32).to(tl.int32), X_BF16, ASM)
    f1, p1 = _x_pairs((v1 >> 32).to(tl.int32), (v5 >> 32).to(tl.int32), X_BF16, ASM)
    f2, p2 = _x_pairs((v2 >> 32).to(tl.int32), (v6 >> 32).to(tl.int32), X_BF16, ASM)
    f3, p3 = _x_pairs((v3 >> 32).to(tl.int32), (v7 >> 32).to(tl.int32), X_BF16, ASM)
    return e0, e1, e2, e3, o0, o1, o2, o3, f0, f1, f2, f3, p0, p1, p2, p3


@triton.jit
def _dot2(we0, we1, we2, we3, wo0, wo1, wo2, wo3, e0, e1, e2, e3, o0, o1, o2, o3, a, FIRST: tl.constexpr,
          ASM: tl.constexpr):
    """Two packed rows (dequantized words ``we*``, ``wo*`` [RB, BLOCK_N]) against their x pairs
    (``e*``, ``o*`` [RB], broadcast over the columns): eight HFMA2 into the float16 chain ``a``
    (the first a multiply when ``FIRST``)."""
    if FIRST:
        a = _h2_mul(we0, e0[:, None], ASM)
    else:
        a = _h2_fma(we0, e0[:, None], a, ASM)
    a = _h2_fma(wo0, o0[:, None], a, ASM)
    a = _h2_fma(we1, e1[:, None], a, ASM)
    a = _h2_fma(wo1, o1[:, None], a, ASM)
    a = _h2_fma(we2, e2[:, None], a, ASM)
    a = _h2_fma(wo2, o2[:, None], a, ASM)
    a = _h2_fma(we3, e3[:, None], a, ASM)
    a = _h2_fma(wo3, o3[:, None], a, ASM)
    return a


@triton.jit
def _row4(xr, mk, jp: tl.constexpr, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, h,
          X_BF16: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """One row of x against packed rows ``4 jp .. 4 jp + 3`` (dequantized words ``a*``..``d*``)."""
    e0, e1, e2, e3, o0, o1, o2, o3, f0, f1, f2, f3, p0, p1, p2, p3 = _x_half(xr, mk, jp, X_BF16, ASM, EVEN)
    h = _dot2(a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, o0, o1, o2, o3, h, jp == 0, ASM)
    return _dot2(c0, c1, c2, c3, d0, d1, d2, d3, f0, f1, f2, f3, p0, p1, p2, p3, h, False, ASM)


@triton.jit
def _gemvt_kernel(
    xw_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, KW_PER_SPLIT, SPLIT_K,
    stride_xm, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr, X_BF16: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_M: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    # xw_ptr: x as int64 words [M, K / 4] (four float16/bfloat16 each), row stride stride_xm words.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    RB: tl.constexpr = BLOCK_K // 64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n2 = tl.minimum(offs_n, N - 1)[None, :].to(tl.int64)  # [1, BLOCK_N], clamped: loads in bounds
    rb = tl.arange(0, RB)[:, None]  # [RB, 1]
    j3 = tl.arange(0, 4)[None, None, :]  # [1, 1, 4] packed row within a half block
    m0 = pid_m * BLOCK_M
    acc0 = tl.zeros((RB, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((RB, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((RB, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((RB, BLOCK_N), dtype=tl.float32)
    h0 = tl.zeros((RB, BLOCK_N), dtype=tl.int32)  # float16 chains (each starts with a multiply)
    h1 = tl.zeros((RB, BLOCK_N), dtype=tl.int32)
    h2 = tl.zeros((RB, BLOCK_N), dtype=tl.int32)
    h3 = tl.zeros((RB, BLOCK_N), dtype=tl.int32)
    # the loop runs over packed rows (K / 8): KW_PER_SPLIT's divisibility (Triton specializes
    # integer arguments divisible by 16) then proves the weight loads 16-byte aligned
    KW: tl.constexpr = BLOCK_K // 8
    kw_lo = pid_k * KW_PER_SPLIT
    kw_hi = tl.minimum(kw_lo + KW_PER_SPLIT, K // 8)
    for kw0 in tl.range(kw_lo, kw_hi, KW):
        kwb = kw0 + 8 * rb  # [RB, 1] first packed row of the block
        kb = 8 * kwb  # [RB, 1] first K column of the block
        mk = kb < K
        g = kb // GROUP_SIZE
        s_lo, s_hi, zc1, zc2 = _h2_group(s_ptr + g * stride_sg + n2 * stride_sn, z_ptr + g * stride_zg + n2 * stride_zn,
                                         stride_sg, stride_zg, mk, GROUP_SIZE, EVEN_K)  # [RB, BLOCK_N] each
        q3 = (qw_ptr + n2 * stride_qn + kwb * stride_qk)[:, :, None] + j3 * stride_qk  # [RB, BLOCK_N, 4]
        kw1 = kw0 + 8 * tl.arange(0, RB)  # [RB] the same blocks, 1-D: x work once per block and thread
        mk1 = 8 * kw1 < K
        xr = xw_ptr + m0 * stride_xm + 2 * kw1  # [RB]
        for jp in tl.static_range(2):  # packed rows 4 jp .. 4 jp + 3 of the block: one 16-byte load
            p0, p1, p2, p3 = _words4(_ld(q3 + 4 * jp * stride_qk, mk[:, :, None], 0, EVEN_K), RB, BLOCK_N)
            a0, a1, a2, a3 = _h2_dequant(p0, zc1, zc2, ASM)
            b0, b1, b2, b3 = _h2_dequant(p1, zc1, zc2, ASM)
            c0, c1, c2, c3 = _h2_dequant(p2, zc1, zc2, ASM)
            d0, d1, d2, d3 = _h2_dequant(p3, zc1, zc2, ASM)
            h0 = _row4(xr, mk1, jp, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, h0,
                       X_BF16, ASM, EVEN_K)
            if BLOCK_M >= 2:
                h1 = _row4(xr + stride_xm, mk1 & (m0 + 1 < M), jp, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                           d0, d1, d2, d3, h1, X_BF16, ASM, EVEN_K and EVEN_M)
            if BLOCK_M >= 3:
                h2 = _row4(xr + 2 * stride_xm, mk1 & (m0 + 2 < M), jp, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                           d0, d1, d2, d3, h2, X_BF16, ASM, EVEN_K and EVEN_M)
            if BLOCK_M >= 4:
                h3 = _row4(xr + 3 * stride_xm, mk1 & (m0 + 3 < M), jp, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                           d0, d1, d2, d3, h3, X_BF16, ASM, EVEN_K and EVEN_M)
        # end of the block's chain: into float32, times the group's scale
        acc0, acc1, acc2, acc3 = _h2_flush4(acc0, acc1, acc2, acc3, h0, h1, h2, h3, s_lo, s_hi, BLOCK_M, ASM)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    y = _h2_rows_out(acc0, acc1, acc2, acc3, BLOCK_M)
    _finish(y, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
            pid_m * tl.num_programs(0) + pid_n, SPLIT_K, HAS_SPLIT)
