"""The float32 CUDA-core W4A16 GEMV (``KERNEL: "gemv"``, small M, any x dtype).

A ``[BLOCK_M, BLOCK_K / 8, BLOCK_N]`` tile of FMAs per nibble into per-row accumulators,
reduced over the rows once at the end; with one group per step the scale and zero point are
applied to the partial sums (two FMAs per 8 weights), else per weight.  About 3 instructions
per weight (offline sm_90 SASS: 5.3 per weight in the loop).  The fallback GEMV where the
packed-half ``gemv2`` does not apply (float32 x, groups not a multiple of 32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.pdl import pdl_start
from kiln.kernels.splitk import finish_tile as _finish
from kiln.kernels.w4a16.jit import _nibble, _x_offsets


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    R: tl.constexpr = BLOCK_K // 8  # packed rows per step
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    m3 = offs_m[:, None, None]
    r3 = offs_r[None, :, None]
    n3 = offs_n[None, None, :]
    mask_m3 = m3 < M
    mask_n3 = n3 < N
    kx3 = _x_offsets(r3, R)
    x_base = x_ptr + m3 * stride_xm + kx3 * stride_xk  # [BLOCK_M, R, 1]
    acc = tl.zeros((BLOCK_M, R, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        xk = x_base + k0 * stride_xk
        if GROUP_SIZE % BLOCK_K == 0:  # one group per step: scale and zero point on the partial sums
            p = tl.load(qw_ptr + (k0 // 8 + r3) * stride_qk + n3 * stride_qn, mask=mask_n3, other=0)
            p_hi = p >> 12
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * stride_sg + n3 * stride_sn, mask=mask_n3, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * stride_zg + n3 * stride_zn, mask=mask_n3, other=0).to(tl.float32)
            a = tl.zeros((BLOCK_M, R, BLOCK_N), dtype=tl.float32)
            xs = tl.zeros((BLOCK_M, R, 1), dtype=tl.float32)
            for i in tl.static_range(8):
                if BLOCK_M == 1:  # row 0 of a one-row tile always exists
                    xi = tl.load(xk + 8 * i * stride_xk).to(tl.float32)
                else:
                    xi = tl.load(xk + 8 * i * stride_xk, mask=mask_m3, other=0.0).to(tl.float32)
                a += _nibble(p, p_hi, i, ASM) * xi
                xs += xi
            acc += (16.0 * s) * a - ((z + 16.0) * s) * xs
        else:  # groups smaller than the step (or K not a multiple of it): per-weight scales
            mask_k3 = k0 + 64 * (r3 // 8) < K
            p = tl.load(qw_ptr + (k0 // 8 + r3) * stride_qk + n3 * stride_qn, mask=mask_k3 & mask_n3, other=0)
            p_hi = p >> 12
            for i in tl.static_range(8):
                g = (k0 + 64 * (r3 // 8) + 8 * i) // GROUP_SIZE
                m2 = mask_k3 & mask_n3
                s = tl.load(s_ptr + g * stride_sg + n3 * stride_sn, mask=m2, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g * stride_zg + n3 * stride_zn, mask=m2, other=0).to(tl.float32)
                w = _nibble(p, p_hi, i, ASM) * (16.0 * s) - (z + 16.0) * s
                xi = tl.load(xk + 8 * i * stride_xk, mask=mask_m3 & mask_k3, other=0.0).to(tl.float32)
                acc += w * xi
    y = tl.sum(acc, axis=1)
    _finish(y, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
            pid_m * tl.num_programs(0) + pid_n, SPLIT_K, HAS_SPLIT)

