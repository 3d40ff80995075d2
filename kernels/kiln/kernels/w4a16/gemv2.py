"""The packed-half W4A16 GEMV (``KERNEL: "gemv2"``: M <= 4, float16/bfloat16 x, G % 32 == 0).

Two weights per instruction (the derivation is in the package docstring): one LOP3 of a
packed word gives the f16x2 pair ``(1024 + q_t, 1024 + q_{t+4})``, one ``fma.rn.f16x2`` folds
the offset and zero point in, then one HFMA2 per two weights and row of x into a float16 chain
of at most 32 products per lane, flushed into float32 times the group's scale.  ``PREFETCH``
1 loads the next step's packed words, scales and zero points before this step's math
(register double buffering).  ``GATED`` (a gate|up weight ``[2I, K]``) stores
``silu(gate) * up`` from the float32 sums: each program takes ``BLOCK_N / 2`` gate columns
and the matching up columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.pdl import pdl_start
from kiln.kernels.splitk import finish_tile as _finish
from kiln.kernels.w4a16.jit import _h2_dequant, _h2_flush4, _h2_group, _h2_rows4, _h2_rows_out, _ld


@triton.jit
def _gemv2_fetch(qw_ptr, s_ptr, z_ptr, kb, n2, mkn, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
                 GROUP_SIZE: tl.constexpr, EVEN: tl.constexpr):
    """The loads of one ``_gemv2_kernel`` step: the eight packed rows of the 64-column blocks
    starting at K columns ``kb`` [RB, 1] for columns ``n2`` [1, BLOCK_N] (int32 words), and the
    blocks' group constants (``_h2_group``)."""
    g = kb // GROUP_SIZE
    s_lo, s_hi, zc1, zc2 = _h2_group(s_ptr + g * stride_sg + n2 * stride_sn, z_ptr + g * stride_zg + n2 * stride_zn,
                                     stride_sg, stride_zg, mkn, GROUP_SIZE, EVEN)
    q_base = qw_ptr + (kb // 8) * stride_qk + n2 * stride_qn
    w0 = _ld(q_base, mkn, 0, EVEN)
    w1 = _ld(q_base + stride_qk, mkn, 0, EVEN)
    w2 = _ld(q_base + 2 * stride_qk, mkn, 0, EVEN)
    w3 = _ld(q_base + 3 * stride_qk, mkn, 0, EVEN)
    w4 = _ld(q_base + 4 * stride_qk, mkn, 0, EVEN)
    w5 = _ld(q_base + 5 * stride_qk, mkn, 0, EVEN)
    w6 = _ld(q_base + 6 * stride_qk, mkn, 0, EVEN)
    w7 = _ld(q_base + 7 * stride_qk, mkn, 0, EVEN)
    return w0, w1, w2, w3, w4, w5, w6, w7, s_lo, s_hi, zc1, zc2


@triton.jit
def _gemv2_kernel(
    xw_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_xm, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHAIN: tl.constexpr, HAS_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, X_BF16: tl.constexpr,
    ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0, GATED: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    # PREFETCH 1: the next step's packed words, scales and zero points are loaded before this
    # step's math (register double buffering: a warp keeps a step of loads in flight while it
    # computes; the last step re-reads itself, an L2 hit, instead of a masked load).
    # xw_ptr: x as int64 words [M, K / 4] (four float16/bfloat16 each), row stride stride_xm words.
    # A step is RB = BLOCK_K / 64 blocks of 64 K columns x BLOCK_N columns of W; tile element
    # (rb, n) walks the block's 8 packed rows, so each thread keeps one block row and reuses its
    # x pairs across all its columns.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    RB: tl.constexpr = BLOCK_K // 64
    HALF: tl.constexpr = BLOCK_N // 2
    if GATED:  # SiLU-and-mul epilogue: N is the intermediate size I of a [2I, K] gate|up weight;
        # tile columns [0, HALF) are gate columns, [HALF, BLOCK_N) the up columns I later
        c = tl.arange(0, BLOCK_N)
        col = pid_n * HALF + c % HALF
        offs_n = col + (c // HALF) * N  # contiguous runs of HALF columns (vector loads stay)
        mask_n = (col < N)[None, :]
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = (offs_n < N)[None, :]
    rb = tl.arange(0, RB)[:, None]  # [RB, 1]
    n2 = offs_n[None, :]  # [1, BLOCK_N]
    m0 = pid_m * BLOCK_M
    acc0 = tl.zeros((RB, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((RB, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((RB, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((RB, BLOCK_N), dtype=tl.float32)
    h0 = tl.zeros((RB, BLOCK_N), dtype=tl.int32)  # float16 chains (each starts with a multiply)
    h1 = tl.zeros((RB, BLOCK_N), dtype=tl.int32)
    h2 = tl.zeros((RB, BLOCK_N), dtype=tl.int32)
    h3 = tl.zeros((RB, BLOCK_N), dtype=tl.int32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    EVEN: tl.constexpr = EVEN_K and EVEN_N
    if PREFETCH:
        k_last = k_lo + ((k_hi - k_lo - 1) // BLOCK_K) * BLOCK_K  # first column of the split's last step
        kf = k_lo + 64 * rb
        f0, f1, f2, f3, f4, f5, f6, f7, fs_lo, fs_hi, fz1, fz2 = _gemv2_fetch(
            qw_ptr, s_ptr, z_ptr, kf, n2, (kf < K) & mask_n, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg,
            stride_zn, GROUP_SIZE, EVEN)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        kb = k0 + 64 * rb  # [RB, 1] first K column of the block row
        mk = kb < K
        mkn = mk & mask_n
        if PREFETCH:
            w0, w1, w2, w3, w4, w5, w6, w7, s_lo, s_hi, zc1, zc2 = f0, f1, f2, f3, f4, f5, f6, f7, fs_lo, fs_hi, fz1, fz2
            kf = tl.minimum(k0 + BLOCK_K, k_last) + 64 * rb
            f0, f1, f2, f3, f4, f5, f6, f7, fs_lo, fs_hi, fz1, fz2 = _gemv2_fetch(
                qw_ptr, s_ptr, z_ptr, kf, n2, (kf < K) & mask_n, stride_qk, stride_qn, stride_sg, stride_sn,
                stride_zg, stride_zn, GROUP_SIZE, EVEN)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7, s_lo, s_hi, zc1, zc2 = _gemv2_fetch(
                qw_ptr, s_ptr, z_ptr, kb, n2, mkn, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
                GROUP_SIZE, EVEN)
        xr = xw_ptr + m0 * stride_xm + kb // 4  # [RB, 1]
        for jp in tl.static_range(2):  # packed rows 4 jp .. 4 jp + 3 of the block
            if jp == 0:
                a0, a1, a2, a3 = _h2_dequant(w0, zc1, zc2, ASM)
                b0, b1, b2, b3 = _h2_dequant(w1, zc1, zc2, ASM)
                c0, c1, c2, c3 = _h2_dequant(w2, zc1, zc2, ASM)
                d0, d1, d2, d3 = _h2_dequant(w3, zc1, zc2, ASM)
            else:
                a0, a1, a2, a3 = _h2_dequant(w4, zc1, zc2, ASM)
                b0, b1, b2, b3 = _h2_dequant(w5, zc1, zc2, ASM)
                c0, c1, c2, c3 = _h2_dequant(w6, zc1, zc2, ASM)
                d0, d1, d2, d3 = _h2_dequant(w7, zc1, zc2, ASM)
            h0 = _h2_rows4(xr, mk, jp, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, h0,
                           (4 * jp) % CHAIN == 0, X_BF16, ASM, EVEN_K)
            if BLOCK_M >= 2:
                h1 = _h2_rows4(xr + stride_xm, mk & (m0 + 1 < M), jp, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                               d0, d1, d2, d3, h1, (4 * jp) % CHAIN == 0, X_BF16, ASM,
                               EVEN_K and EVEN_M)
            if BLOCK_M >= 3:
                h2 = _h2_rows4(xr + 2 * stride_xm, mk & (m0 + 2 < M), jp, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2,
                               c3, d0, d1, d2, d3, h2, (4 * jp) % CHAIN == 0, X_BF16, ASM,
                               EVEN_K and EVEN_M)
            if BLOCK_M >= 4:
                h3 = _h2_rows4(xr + 3 * stride_xm, mk & (m0 + 3 < M), jp, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2,
                               c3, d0, d1, d2, d3, h3, (4 * jp) % CHAIN == 0, X_BF16, ASM,
                               EVEN_K and EVEN_M)
            if (4 * jp + 4) % CHAIN == 0:  # end of a chain: into float32 (the next one starts with a multiply)
                acc0, acc1, acc2, acc3 = _h2_flush4(acc0, acc1, acc2, acc3, h0, h1, h2, h3, s_lo, s_hi, BLOCK_M, ASM)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    y = _h2_rows_out(acc0, acc1, acc2, acc3, BLOCK_M)
    if GATED:  # silu(gate) * up from the float32 sums (no split: the launcher asks for SPLIT_K 1)
        gate, up = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        act = gate / (1.0 + tl.exp(-gate)) * up
        offs_h = pid_n * HALF + tl.arange(0, HALF)
        mask = (offs_m < M)[:, None] & (offs_h < N)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_h[None, :] * stride_on,
                 act.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        _finish(y, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
                pid_m * tl.num_programs(0) + pid_n, SPLIT_K, HAS_SPLIT)

