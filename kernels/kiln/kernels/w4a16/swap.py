"""Tensor-core W4A16 kernel for small M (1..16): the weight is the A operand ("swap AB").

``y^T = W x^T``: a program computes a ``[BLOCK_N, BLOCK_M]`` tile of ``y^T`` with the
dequantized weight tile in registers as the A operand of ``tl.dot`` and the few rows of x as
the B operand.  On Hopper Triton lowers a dot whose A operand is computed in registers to
``wgmma`` with A from registers (B from shared memory), so the weights go global -> shared
(``cp.async`` pipeline) -> registers -> tensor cores without a shared-memory round trip of the
dequantized values; BLOCK_M = 8 uses ``mma.sync``.  Swapping A and B for small M is what
TensorRT-LLM's "swapAB" GEMMs and vLLM's Machete (mixed-input GEMM on Hopper) do; the code
here is Kiln's own.

Dequantization, two weights per instruction: a packed word of the format (``kiln.kernels.int4_format``: nibble ``i`` of packed row ``r`` in block ``b`` is ``W[n, 64 b + 8 i + r]``) ANDed
with ``0x000F000F`` after a right shift by ``4 t`` holds nibbles ``t`` and ``t + 4`` in the low
bits of its two 16-bit halves; OR-ing ``0x4300`` (bfloat16 128.0) or ``0x6400`` (float16
1024.0) into both halves (one LOP3 for AND and OR) gives the exact pair ``(OFFSET + q_t,
OFFSET + q_{t+4})`` as one packed register: the pair of consecutive K elements that a
tensor-core A fragment register holds.  So the dot's K order is a permutation of the true K
columns (element ``2 r + j`` of pair set ``t`` is column ``64 (r // 8) + 8 (t + 4 j) + r % 8``)
and x's B operands are cut from its step tile in the same order.  Per group and column the offset
and zero point come off the float32 dot result: ``sum_k (q - z) s x = s (sum (OFFSET + q) x - (OFFSET + z) sum x)``
(``GROUP_SIZE % BLOCK_K == 0``: one group per step).  Offline sm_90 SASS of the loop
(BLOCK_N 128, BLOCK_K 128, M 16, 4 warps): ~0.13 warp instructions per weight, against ~0.20
for the ``mma`` kernel (float32 nibbles converted to bfloat16).

x is read once per step as a ``[BLOCK_K, BLOCK_M]`` tile and cut into the four B operands with
reshape / permute / split (per-element gathers of x cost 33 scalar loads per thread and step,
on the critical path); with ``PREFETCH`` the x tile, scales and zero points of the next step
are loaded while the current one is computed (Triton's pipeliner only stages the weights).
H200, Llama-3.1-8B projections (docs/benchmarks.md, "W4A16"): gather -> tile + prefetch took
gate_up at M = 8 from 47.0 to 39.2 us and down from 29.7 to 22.5 us; the kernel is the fastest
at M = 4..16 (1.13-1.72x bf16 cuBLAS), the packed-half GEMV (``gemv2``) at M = 1, 2.  Its time
hardly depends on M (gate_up 38-41 us for M = 1..16, ~1.5 TB/s): neither issue (~12 us of
instructions) nor DRAM bandwidth (~15 us) bounds it; the weights still go to shared memory as
4-byte ``cp.async`` copies (the shared layout Triton picks is K-major).  Stored K-major, the
same words make M = 4 1.1-1.35x faster (gate_up 39 -> 29 us) but the M = 1 GEMV slower, so the
format stays N-major (docs/benchmarks.md).

Without ``ASM`` (the CPU interpreter) the same values are computed with integer ops.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.pdl import pdl_start
from kiln.kernels.splitk import finish_tile as _finish

# one LOP3 per packed word (already shifted right by 4 t): AND 0x000F000F, OR the offset's bits
_LOP3_BF16 = tl.constexpr("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;")  # 128 + q (bfloat16)
_LOP3_F16 = tl.constexpr("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xEA;")  # 1024 + q (float16)


@triton.jit
def _code_pairs(p, T: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, X_F16: tl.constexpr,
                ASM: tl.constexpr):
    """``[BLOCK_N, 2 R]`` in x's dtype: element ``(n, 2 r + j)`` = OFFSET + nibble ``T + 4 j`` of
    the packed word ``p[n, r]`` (exact; OFFSET 128 for bfloat16, 1024 for float16)."""
    if T > 0:
        p = p >> (4 * T)  # (arithmetic: the sign bits land above bit 19, outside the mask)
    pp = tl.join(p, p).reshape(BLOCK_N, 2 * R)  # both elements of a pair read the same word
    if ASM:  # pack=2: one 32-bit result register holds the pair (element 2 r in its low half)
        if X_F16:
            w = tl.inline_asm_elementwise(_LOP3_F16, "=r,r,r", [pp], dtype=tl.float16, is_pure=True, pack=2)
        else:
            w = tl.inline_asm_elementwise(_LOP3_BF16, "=r,r,r", [pp], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        q = (pp >> (16 * (tl.arange(0, 2 * R) % 2))[None, :]) & 0xF
        if X_F16:
            w = (q + 1024).to(tl.float32).to(tl.float16)
        else:
            w = (q + 128).to(tl.float32).to(tl.bfloat16)
    return w


@triton.jit
def _step_loads(x_ptr, s_ptr, z_ptr, k0, valid, offs_m, offs_n, mask_m, mask_n, stride_xm, stride_xk, stride_sg,
                stride_sn, stride_zg, stride_zn, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """x ``[BLOCK_K, BLOCK_M]`` (K-major: the B operand's orientation), scales and zero points
    ``[BLOCK_N]`` of the step at ``k0`` (zeros where ``valid`` is false: past the split)."""
    kr = k0 + tl.arange(0, BLOCK_K)
    xrow = tl.trans(tl.load(x_ptr + offs_m[:, None] * stride_xm + kr[None, :] * stride_xk,
                            mask=mask_m[:, None] & valid, other=0.0))  # loaded K-contiguous (vector loads)
    g = k0 // GROUP_SIZE
    s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n & valid, other=0.0)
    z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n & valid, other=0)
    return xrow, s, z


@triton.jit
def _swap_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, ASM: tl.constexpr, X_F16: tl.constexpr,
    EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    # GROUP_SIZE % BLOCK_K == 0 and K % GROUP_SIZE == 0, so every step is whole in K
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    R: tl.constexpr = BLOCK_K // 8  # packed rows per step
    OFFSET: tl.constexpr = 1024.0 if X_F16 else 128.0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if PREFETCH:  # the first step's x, scales and zero points (then one step ahead, in registers)
        xrow_n, s_n, z_n = _step_loads(x_ptr, s_ptr, z_ptr, k_lo, k_lo < k_hi, offs_m, offs_n, mask_m, mask_n,
                                       stride_xm, stride_xk, stride_sg, stride_sn, stride_zg, stride_zn,
                                       GROUP_SIZE, BLOCK_K)
    q_base = qw_ptr + offs_r[None, :] * stride_qk + offs_n[:, None] * stride_qn
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_N:
            p = tl.load(q_base + (k0 // 8) * stride_qk)
        else:
            p = tl.load(q_base + (k0 // 8) * stride_qk, mask=mask_n[:, None], other=0)
        if PREFETCH:
            xrow, s, z = xrow_n, s_n, z_n
            xrow_n, s_n, z_n = _step_loads(x_ptr, s_ptr, z_ptr, k0 + BLOCK_K, k0 + BLOCK_K < k_hi, offs_m, offs_n,
                                           mask_m, mask_n, stride_xm, stride_xk, stride_sg, stride_sn, stride_zg,
                                           stride_zn, GROUP_SIZE, BLOCK_K)
        else:
            xrow, s, z = _step_loads(x_ptr, s_ptr, z_ptr, k0, True, offs_m, offs_n, mask_m, mask_n, stride_xm,
                                     stride_xk, stride_sg, stride_sn, stride_zg, stride_zn, GROUP_SIZE, BLOCK_K)
        s = s.to(tl.float32)
        z = z.to(tl.float32)
        xs = tl.sum(xrow.to(tl.float32), axis=0)  # [BLOCK_M]: the step's sum of x
        # the four B operands from the step's x tile (no gathers): column
        # 64 b + 32 j + 8 t + r' of the step is row 2 (8 b + r') + j of operand t = 2 t1 + t0
        x6 = tl.reshape(xrow, (BLOCK_K // 64, 2, 2, 2, 8, BLOCK_M))  # (b, j, t1, t0, r', m)
        x6 = tl.permute(x6, (0, 4, 1, 5, 2, 3))  # (b, r', j, m, t1, t0)
        x4 = tl.reshape(x6, (2 * R, BLOCK_M, 2, 2))
        xa, xb = tl.split(x4)  # t0 = 0, 1 (the last axis)
        x0, x2 = tl.split(xa)  # t = 0, 2
        x1, x3 = tl.split(xb)  # t = 1, 3
        raw = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        raw = tl.dot(_code_pairs(p, 0, BLOCK_N, R, X_F16, ASM), x0, raw)
        raw = tl.dot(_code_pairs(p, 1, BLOCK_N, R, X_F16, ASM), x1, raw)
        raw = tl.dot(_code_pairs(p, 2, BLOCK_N, R, X_F16, ASM), x2, raw)
        raw = tl.dot(_code_pairs(p, 3, BLOCK_N, R, X_F16, ASM), x3, raw)
        acc += s[:, None] * raw - (s * (z + OFFSET))[:, None] * xs[None, :]
    _finish(tl.trans(acc), out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
            pid_m * tl.num_programs(0) + pid_n, SPLIT_K, HAS_SPLIT)
