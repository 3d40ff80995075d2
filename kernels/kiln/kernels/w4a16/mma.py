"""The tensor-core W4A16 kernel with x as the A operand (``KERNEL: "mma"``; M up to 64 on
CUDA, any M elsewhere).

Eight ``tl.dot`` of depth ``BLOCK_K / 8`` per step on the nibble values ``f = 1 + q / 16``
(exact in bf16/fp16), with the group's scale and zero point applied to the float32 dot
result (``sum_k (q - z) s x = 16 s sum f x - (16 + z) s sum x``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.pdl import pdl_start
from kiln.kernels.splitk import finish_tile as _finish
from kiln.kernels.w4a16.jit import _nibble, _x_offsets


@triton.jit
def _mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, ASM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    R: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    mask_m = offs_m < M
    mask_n = offs_n < N
    kx = _x_offsets(offs_r, R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if GROUP_SIZE % BLOCK_K == 0:
            p = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=mask_n[None, :], other=0)
            p_hi = p >> 12
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0).to(tl.float32)
            raw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            xrow = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + tl.arange(0, BLOCK_K))[None, :] * stride_xk,
                           mask=mask_m[:, None], other=0.0)
            xs = tl.sum(xrow.to(DOT_DTYPE).to(tl.float32), axis=1)  # the step's sum of x, as the dots see it
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + kx + 8 * i)[None, :] * stride_xk,
                             mask=mask_m[:, None], other=0.0).to(DOT_DTYPE)
                raw = tl.dot(xi, _nibble(p, p_hi, i, ASM).to(DOT_DTYPE), raw, input_precision=DOT_PREC)
            acc += (16.0 * s)[None, :] * raw - ((z + 16.0) * s)[None, :] * xs[:, None]
        else:
            mask_k = k0 + 64 * (offs_r // 8) < K
            m2 = mask_k[:, None] & mask_n[None, :]
            p = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=m2, other=0)
            p_hi = p >> 12
            for i in tl.static_range(8):
                g = (k0 + 64 * (offs_r // 8) + 8 * i) // GROUP_SIZE
                s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=m2, other=0.0)
                z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=m2, other=0)
                s = s.to(tl.float32)
                w = (_nibble(p, p_hi, i, ASM) * (16.0 * s) - (z.to(tl.float32) + 16.0) * s).to(DOT_DTYPE)
                xi = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + kx + 8 * i)[None, :] * stride_xk,
                             mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(DOT_DTYPE)
                acc = tl.dot(xi, w, acc, input_precision=DOT_PREC)
    _finish(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
            pid_m * tl.num_programs(0) + pid_n, SPLIT_K, HAS_SPLIT)


# Measured launch configs: (N, K, M bucket) -> config, buckets 1, 2, 4, 8, 16 (M = 3 uses 4's,
