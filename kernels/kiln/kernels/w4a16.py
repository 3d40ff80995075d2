"""W4A16 GEMM: ``y = x @ W^T`` with ``W`` stored as packed int4 and ``x`` in float16/bfloat16
(float32 too, for tests), dequantized in registers.

Weight format (Kiln's ``quantization.int4``, format 2; ``W`` is [N, K], group size ``G``,
``K % 64 == 0``, ``G % 8 == 0``):

* ``qweight`` int32 ``[K // 8, N]``.  K is cut into blocks of 64; packed row ``8 b + r``
  (``r < 8``) of block ``b`` holds in bits ``4i..4i+3`` the code (0..15) of
  ``W[n, 64 b + 8 i + r]``.  The eight rows of a block and nibble ``i`` thus cover eight
  *contiguous* K columns (one 16-byte load of x per nibble), and a group boundary (a multiple
  of 8) never falls inside a row;
* ``scales`` float16 ``[K // G, N]``, ``qzeros`` uint8 ``[K // G, N]``;
* ``W[n, k] = (code - qzeros[k // G, n]) * scales[k // G, n]``.

Dequantization: nibble ``i`` is shifted to mantissa bits 19..22 and OR-ed into ``1.0f``: one
shift and one AND/OR per weight give ``f = 1 + q / 16`` exactly (no int-to-float
conversion, no per-weight scale).  Within one group ``sum_k (q - z) s x = 16 s sum f x -
(16 + z) s sum x``, so the scale and zero point are applied once per group and column to the
partial sums (two FMAs per 8 weights), not to each weight.

Kernels:

* ``_gemv_kernel`` (small M, no tensor cores): a ``[BLOCK_M, BLOCK_K / 8, BLOCK_N]`` tile of
  FMAs per nibble into per-row accumulators, reduced over the rows once at the end.  At
  M = 1 the weight stream is the whole cost: it needs about 3 instructions per weight.
* ``_gemv2_kernel`` (M <= 4, float16/bfloat16 x, G % 32 == 0; ``KERNEL: "gemv2"``): packed
  half math, two weights per instruction.  The trick of FasterTransformer's
  ``interleaved_numeric_conversion.h``, Marlin (Frantar et al., 2024, ``dequant``) and
  LMDeploy's ``lop3``-based int4 converters (re-derived here, no code taken): one LOP3 of a packed
  word with ``0x000F000F`` (or ``0x00F000F0``) and ``0x64006400`` gives the f16x2 pair
  ``(1024 + q_t, 1024 + q_{t+4})`` (or ``1024 + 16 q``) for nibbles t and t + 4; one
  ``fma.rn.f16x2`` with 1/16 (1/256) and the per-group word ``-(1024 + z) / 16``
  (``-(64 + z) / 16``, built from z with integer ops) gives ``(q - z) / 16`` exactly, so the
  offset and the zero point cost nothing extra (for G = 32 the two lanes are in different
  groups: each lane gets its own z and scale).  x is read as int64 words and paired to the
  same lane order (PRMT for float16; bfloat16 is widened and rounded to float16 with
  ``cvt.rn.f16x2.f32``, once per step and thread, reused over the thread's 8-16 columns).
  Then one HFMA2 per two weights and row of x into a float16 chain of at most 32 products per
  lane (one 64-column block, ``CHAIN`` = 8 packed rows; 4 halves it), which is converted and
  added, times the group's scale, into float32.  Per 8 weights: one shift, 4 LOP3, 4 + 4 M HFMA2;
  offline sm_90 SASS of the loop (bf16 x, M = 1): 2.2 instructions per weight at BLOCK_N = 256,
  2.0 at 512 (2.07 for float16 x), against 5.3 for ``_gemv_kernel``.  Precision: weights
  ``(q - z)/16`` are exact, products and the 32-long chains are rounded to float16 (relative
  error ~1e-3 against the float32 reference, at the size of bfloat16's own output rounding);
  x is converted to float16, so |x| must stay below 65504 and a block's partial sum below that
  too (activations of a working bf16 model are far below; float32 x is rounded to float16).
  Why not bfloat16 math for bf16 x: ``0x4300 | q`` = 128 + q is exact too, but a chain in
  ``fma.rn.bf16x2`` keeps 8 mantissa bits (~1 % error after 32 terms), and nibble pairs
  shifted by 4 (``0x00F0``) leave its 7-bit mantissa; float16 with one conversion of x per
  block is both more exact and fewer instructions.  Without ``ASM`` (CPU interpreter) the
  same words are computed lane by lane with integer and float32 ops (same bits, same order).
  H200 launch choice: narrow tiles (32-64 columns x 512-1024 K per step, 2-4 K splits) win at
  M = 1, 2 on all four Llama-3.1-8B projections; they stream the int4 bytes at 47-66 % of a
  pure read of the same bytes (docs/benchmarks.md, session 7).  Nsight Compute (session 9):
  25-62 % occupancy and half the stall cycles waiting on global loads, which the loop issued
  interleaved with the math; ``PREFETCH`` 1 loads the next step's packed words, scales and
  zero points before this step's math (register double buffering), and with 2048-wide steps
  and no K split it wins on qkv and o (M = 1, 2) and gate_up (M = 2).  ``GATED`` (a gate|up
  weight ``[2I, K]``, ``w4a16_gemm(..., silu_and_mul=True)``): each program takes BLOCK_N / 2
  gate columns and the matching up columns (two contiguous runs, so the loads stay vectorized)
  and stores ``silu(gate) * up`` from its float32 sums: no SiLU-and-mul kernel and no
  ``[M, 2I]`` round trip (H200, batch-1 int4 decode of the 8B shape: 2.073 / 2.074 ms of GPU
  per step vs 2.082 / 2.083 unfused, session 11).  ``EARLY`` loads the first weight step
  before the PDL wait (``early_fetch``; off, measured slower in the decode step).
* ``_mma_kernel`` (larger M): eight ``tl.dot`` of depth ``BLOCK_K / 8`` per step on the same
  ``f`` values (exact in bf16/fp16), group correction on the fp32 dot result.
* ``w4a16_swap._swap_kernel`` (M <= 16, float16/bfloat16 x, ``G % BLOCK_K == 0``; ``KERNEL:
  "swap"``): the weight as the A operand of the tensor cores, two codes per LOP3 (that
  module's docstring).  H200 (Llama-3.1-8B projections): the fastest kernel at M = 4..16,
  1.4-1.5x ``_mma_kernel`` at M = 8 and 1.1-1.25x ``gemv2`` at M = 4; exact to ~1e-4 (the
  packed-half GEMVs: ~1.7e-3).

* ``w4a16_gemvt._gemvt_kernel`` (M <= 4, weights stored K-major by ``to_kmajor``; ``KERNEL:
  "gemvt"``): the packed-half GEMV with each program streaming whole columns (that module's
  docstring; ``TUNED_KMAJOR``).
* ``w4a16_dequant`` (``KERNEL: "dequant"``, CUDA default from ``DEQUANT_MIN_M`` rows): the
  weight dequantized to x's dtype, then a dense GEMM (cuBLAS).

All split K over ``SPLIT_K`` programs for small M (N / BLOCK_N tiles alone do not fill 132
SMs), reduced in the same launch (``kiln.kernels.splitk``: partials added in split order by
the last program of a tile).  Launch choices live in ``choose_config`` and ``TUNED``
(measured numbers in docs/benchmarks.md, "GPU (H200)").  On Hopper every kernel is launched
with programmatic dependent launch (``kiln.kernels.pdl``): it waits for its predecessor
before its first load (``gemv2`` with ``EARLY``: its first weight loads, constants, come
before the wait), and all its writes (partials, counters, ``y``) come after that.

``dequantize_ref`` / ``w4a16_ref`` are the torch reference (dequantize, then matmul in
float32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import launch_kwargs, pdl_start
from .splitk import counters as _counters
from .splitk import finish_tile as _finish

__all__ = ["w4a16_gemm", "w4a16_ref", "dequantize_ref", "choose_config", "m_bucket", "TUNED", "TUNED_KMAJOR",
           "KBLOCK", "is_kmajor", "to_kmajor"]

KBLOCK = 64  # K columns per interleave block of the packed format


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    """float32 ``W`` [N, K] from the packed format (torch reference)."""
    K8, N = qweight.shape
    K = K8 * 8
    shifts = (torch.arange(8, dtype=torch.int32, device=qweight.device) * 4).view(1, 8, 1)
    codes = (qweight.unsqueeze(1) >> shifts) & 0xF  # [K/8, 8 (i), N]: row 8b + r, nibble i
    codes = codes.reshape(K // KBLOCK, 8, 8, N).transpose(1, 2).reshape(K, N).float()  # k = 64b + 8i + r
    G = K // scales.shape[0]
    s = scales.float().repeat_interleave(G, dim=0)
    z = qzeros.float().repeat_interleave(G, dim=0)
    return ((codes - z) * s).t().contiguous()


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    """Reference ``x`` [M, K] @ dequant(W)^T -> [M, N] in ``x.dtype`` (float32 math)."""
    return (x.float() @ dequantize_ref(qweight, scales, qzeros).t()).to(x.dtype)


@triton.jit
def _nibble(p, p_hi, i: tl.constexpr, ASM: tl.constexpr):
    """``1 + q / 16`` (float32, exact) for nibble ``i`` of the int32 words ``p``
    (``p_hi = p >> 12``: nibbles 5..7 come from it with left shifts too)."""
    if i <= 4:
        c = p << (19 - 4 * i)
    else:
        c = p_hi << (19 - 4 * (i - 3))
    if ASM:  # one LOP3 for the AND and the OR (ptxas emits two for the plain expression)
        c = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x780000, 0x3F800000, 0xEA;", "=r,r", [c],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        c = (c & 0x780000) | 0x3F800000
    return c.to(tl.float32, bitcast=True)


@triton.jit
def _x_offsets(offs_r, R: tl.constexpr):
    """K offset (within a step) of nibble 0 of packed row ``r``: ``64 (r // 8) + r % 8``."""
    if R == 8:
        return offs_r  # one block per step: contiguous (vector loads of x)
    else:
        return 64 * (offs_r // 8) + offs_r % 8


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


# -- packed-half GEMV (M <= 4) --------------------------------------------------------------
# f16x2 words travel as int32 tensors (one word = two float16 lanes, low lane first).  With
# ASM the helpers below are one PTX instruction (or a few) per word; without it (the CPU
# interpreter) they compute the same lanes with unpack / float32 math / round / repack.
_H2_ONE_16TH = tl.constexpr(0x2C002C00)  # (1/16, 1/16)
_H2_ONE_256TH = tl.constexpr(0x1C001C00)  # (1/256, 1/256)
_H2_MAGIC = tl.constexpr(0x64006400)  # (1024, 1024): OR a nibble into the mantissa -> 1024 + q (or + 16 q)
_H2_ZC1 = tl.constexpr(0xD400D400 - (1 << 32))  # (-64, -64) as int32; | z -> -(64 + z/16) = -(1024 + z)/16
_H2_ZC2 = tl.constexpr(0xC400C400 - (1 << 32))  # (-4, -4) as int32; | (z << 4) -> -(4 + z/16) = -(64 + z)/16
_HI16 = tl.constexpr(-65536)  # 0xFFFF0000

_DEQUANT_ASM = tl.constexpr("""{
.reg .b32 t, u, v;
lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, $4, 8;
lop3.b32 $2, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $3, t, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 u, 0x2C002C00;
mov.b32 v, 0x1C001C00;
fma.rn.f16x2 $0, $0, u, $5;
fma.rn.f16x2 $1, $1, v, $6;
fma.rn.f16x2 $2, $2, u, $5;
fma.rn.f16x2 $3, $3, v, $6;
}""")

_XPAIR_F16_ASM = tl.constexpr("prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;")
_XPAIR_BF16_ASM = tl.constexpr("""{
.reg .b32 al, ah, bl, bh;
shl.b32 al, $2, 16;
and.b32 ah, $2, 0xFFFF0000;
shl.b32 bl, $3, 16;
and.b32 bh, $3, 0xFFFF0000;
cvt.rn.f16x2.f32 $0, bl, al;
cvt.rn.f16x2.f32 $1, bh, ah;
}""")


@triton.jit
def _h2_lo(w):
    """float32 value of the low float16 lane of int32 words ``w`` (fallback path)."""
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_hi(w):
    """float32 value of the high float16 lane of int32 words ``w`` (fallback path)."""
    return (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_pack(lo, hi):
    """int32 word of two float16 lanes (rounded from float32; fallback path)."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def _h2_fma(a, b, c, ASM: tl.constexpr):
    """``a * b + c`` per float16 lane (``fma.rn.f16x2``: one HFMA2)."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _h2_pack(_h2_lo(a) * _h2_lo(b) + _h2_lo(c), _h2_hi(a) * _h2_hi(b) + _h2_hi(c))


@triton.jit
def _h2_mul(a, b, ASM: tl.constexpr):
    """``a * b`` per float16 lane (``mul.rn.f16x2``: starts a chain without zeroing it)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return _h2_pack(_h2_lo(a) * _h2_lo(b), _h2_hi(a) * _h2_hi(b))


@triton.jit
def _h2_dequant(p, zc1, zc2, ASM: tl.constexpr):
    """Words ``((q_t - z_lo) / 16, (q_{t+4} - z_hi) / 16)`` for t = 0..3 (float16, exact) of the
    packed int32 words ``p`` (nibble i = bits 4i..4i+3), given ``zc1 = -(1024 + z) / 16`` and
    ``zc2 = -(64 + z) / 16`` per lane: one shift, four LOP3 and four HFMA2 per 8 weights."""
    if ASM:
        return tl.inline_asm_elementwise(_DEQUANT_ASM, "=r,=r,=r,=r,r,r,r", [p, zc1, zc2],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        t = (p >> 8) & 0xFFFFFF  # logical shift
        u = tl.full(p.shape, _H2_ONE_16TH, tl.int32)
        v = tl.full(p.shape, _H2_ONE_256TH, tl.int32)
        w0 = _h2_fma((p & 0x000F000F) | _H2_MAGIC, u, zc1, False)  # (1024 + q) / 16 - (1024 + z) / 16
        w1 = _h2_fma((p & 0x00F000F0) | _H2_MAGIC, v, zc2, False)  # (1024 + 16 q) / 256 - (64 + z) / 16
        w2 = _h2_fma((t & 0x000F000F) | _H2_MAGIC, u, zc1, False)
        w3 = _h2_fma((t & 0x00F000F0) | _H2_MAGIC, v, zc2, False)
        return w0, w1, w2, w3


@triton.jit
def _x_pairs(a, b, X_BF16: tl.constexpr, ASM: tl.constexpr):
    """From two words of x (``a = (x[k], x[k+1])``, ``b = (x[k'], x[k'+1])``, float16 or bfloat16)
    the float16 words ``(x[k], x[k'])`` and ``(x[k+1], x[k'+1])``."""
    if ASM:
        if X_BF16:
            return tl.inline_asm_elementwise(_XPAIR_BF16_ASM, "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_XPAIR_F16_ASM, "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)
    else:
        if X_BF16:
            al = (a << 16).to(tl.float32, bitcast=True)
            ah = (a & _HI16).to(tl.float32, bitcast=True)
            bl = (b << 16).to(tl.float32, bitcast=True)
            bh = (b & _HI16).to(tl.float32, bitcast=True)
            return _h2_pack(al, bl), _h2_pack(ah, bh)
        else:
            return (a & 0xFFFF) | (b << 16), ((a >> 16) & 0xFFFF) | (b & _HI16)


@triton.jit
def _h2_to_f32(w, ASM: tl.constexpr):
    """The two float16 lanes of ``w`` as float32 (two conversions)."""
    if ASM:
        return tl.inline_asm_elementwise("{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
                                         "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return _h2_lo(w), _h2_hi(w)


@triton.jit
def _h2_row(x0, x1, x2, x3, x4, x5, x6, x7, we0, we1, we2, we3, wo0, wo1, wo2, wo3, a, FIRST: tl.constexpr,
            X_BF16: tl.constexpr, ASM: tl.constexpr):
    """One row of x against two packed rows of a 64-column block (``we*``: row 2 jj, ``wo*``:
    row 2 jj + 1, from ``_h2_dequant``): eight HFMA2 into the float16 chain ``a`` (the first one
    a multiply when ``FIRST``).  ``x<i>`` [RB, 1]: the int32 word of x holding block columns
    ``8 i + 2 jj`` and ``8 i + 2 jj + 1``."""
    xe, xo = _x_pairs(x0, x4, X_BF16, ASM)
    if FIRST:
        a = _h2_mul(we0, xe, ASM)
    else:
        a = _h2_fma(we0, xe, a, ASM)
    a = _h2_fma(wo0, xo, a, ASM)
    xe, xo = _x_pairs(x1, x5, X_BF16, ASM)
    a = _h2_fma(we1, xe, a, ASM)
    a = _h2_fma(wo1, xo, a, ASM)
    xe, xo = _x_pairs(x2, x6, X_BF16, ASM)
    a = _h2_fma(we2, xe, a, ASM)
    a = _h2_fma(wo2, xo, a, ASM)
    xe, xo = _x_pairs(x3, x7, X_BF16, ASM)
    a = _h2_fma(we3, xe, a, ASM)
    a = _h2_fma(wo3, xo, a, ASM)
    return a


@triton.jit
def _h2_rows4(xr, mk, jp: tl.constexpr, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, acc,
              FIRST: tl.constexpr, X_BF16: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """One row of x against packed rows ``4 jp .. 4 jp + 3`` of a 64-column block (dequantized
    words ``a*``, ``b*``, ``c*``, ``d*``).  ``xr`` [RB, 1]: the block's first int64 word of x
    (four float16/bfloat16); word ``2 i + jp`` holds block columns ``8 i + 4 jp .. + 3``.
    ``EVEN``: no masks (``mk`` all true)."""
    v0 = _ld(xr + jp, mk, 0, EVEN)
    v1 = _ld(xr + 2 + jp, mk, 0, EVEN)
    v2 = _ld(xr + 4 + jp, mk, 0, EVEN)
    v3 = _ld(xr + 6 + jp, mk, 0, EVEN)
    v4 = _ld(xr + 8 + jp, mk, 0, EVEN)
    v5 = _ld(xr + 10 + jp, mk, 0, EVEN)
    v6 = _ld(xr + 12 + jp, mk, 0, EVEN)
    v7 = _ld(xr + 14 + jp, mk, 0, EVEN)
    acc = _h2_row(v0.to(tl.int32), v1.to(tl.int32), v2.to(tl.int32), v3.to(tl.int32), v4.to(tl.int32),
                  v5.to(tl.int32), v6.to(tl.int32), v7.to(tl.int32), a0, a1, a2, a3, b0, b1, b2, b3, acc, FIRST,
                  X_BF16, ASM)
    acc = _h2_row((v0 >> 32).to(tl.int32), (v1 >> 32).to(tl.int32), (v2 >> 32).to(tl.int32),
                  (v3 >> 32).to(tl.int32), (v4 >> 32).to(tl.int32), (v5 >> 32).to(tl.int32),
                  (v6 >> 32).to(tl.int32), (v7 >> 32).to(tl.int32), c0, c1, c2, c3, d0, d1, d2, d3, acc, False,
                  X_BF16, ASM)
    return acc


@triton.jit
def _ld(ptrs, mask, other, EVEN: tl.constexpr):
    """``tl.load`` that drops the mask when the tile is known to be in range (a masked load also
    zero-fills its registers first: one more instruction per two registers)."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _h2_flush(acc, a, s_lo, s_hi, ASM: tl.constexpr):
    """Add the float16 chain ``a`` into the float32 accumulator, each lane times its group's scale."""
    lo, hi = _h2_to_f32(a, ASM)
    return acc + s_lo * lo + s_hi * hi


@triton.jit
def _h2_group(s_ptrs, z_ptrs, stride_sg, stride_zg, mask, GROUP_SIZE: tl.constexpr, EVEN: tl.constexpr):
    """Per (block, column) group constants of the packed-half kernels from the scale and zero
    point pointers of the block's first group: the float32 scales of the low and high lanes
    (``s_lo``, ``s_hi``; different groups when G = 32: nibbles 4..7 are in the next group) and
    the zero-point words ``zc1 = -(1024 + z) / 16``, ``zc2 = -(64 + z) / 16`` per lane that
    ``_h2_dequant`` folds in."""
    s_lo = _ld(s_ptrs, mask, 0.0, EVEN).to(tl.float32)
    z = _ld(z_ptrs, mask, 0, EVEN).to(tl.int32)
    if GROUP_SIZE == 32:  # nibbles 4..7 (the high lanes) are in the next group
        s_hi = _ld(s_ptrs + stride_sg, mask, 0.0, EVEN).to(tl.float32)
        zz = z | (_ld(z_ptrs + stride_zg, mask, 0, EVEN).to(tl.int32) << 16)
    else:
        s_hi = s_lo
        zz = z * 0x10001
    return s_lo, s_hi, zz | _H2_ZC1, (zz << 4) | _H2_ZC2


@triton.jit
def _h2_flush4(acc0, acc1, acc2, acc3, h0, h1, h2, h3, s_lo, s_hi, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """``_h2_flush`` of the chains of the first ``BLOCK_M`` rows of x (the rest pass through)."""
    acc0 = _h2_flush(acc0, h0, s_lo, s_hi, ASM)
    if BLOCK_M >= 2:
        acc1 = _h2_flush(acc1, h1, s_lo, s_hi, ASM)
    if BLOCK_M >= 3:
        acc2 = _h2_flush(acc2, h2, s_lo, s_hi, ASM)
    if BLOCK_M >= 4:
        acc3 = _h2_flush(acc3, h3, s_lo, s_hi, ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _h2_rows_out(acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_N]`` result from the per-row float32 accumulators ``[RB, BLOCK_N]``
    (summed over the block rows; times 16: the weights were ``(q - z) / 16``)."""
    rows = tl.arange(0, BLOCK_M)[:, None]
    y = tl.where(rows == 0, 16.0 * tl.sum(acc0, axis=0)[None, :], 0.0)
    if BLOCK_M >= 2:
        y = tl.where(rows == 1, 16.0 * tl.sum(acc1, axis=0)[None, :], y)
    if BLOCK_M >= 3:
        y = tl.where(rows == 2, 16.0 * tl.sum(acc2, axis=0)[None, :], y)
    if BLOCK_M >= 4:
        y = tl.where(rows == 3, 16.0 * tl.sum(acc3, axis=0)[None, :], y)
    return y


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
    PREFETCH: tl.constexpr = 0, EARLY: tl.constexpr = False, GATED: tl.constexpr = False,
):
    if EARLY == 0:
        pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    # EARLY (with PREFETCH 1): the first step's packed words, scales and zero points are loaded
    # *before* the programmatic-dependent-launch wait: the weights are constants, so their loads
    # need not wait for the predecessor kernel (in a decode step a norm, the attention merge or
    # SiLU-and-mul: short, latency-bound kernels that leave the memory system idle); x, the
    # partials and the split-K counters are touched only after the wait.
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
    if EARLY:
        pdl_start(PDL)
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
# 5..8 use 8's, 9..16 use 16's).  H200 sweep (``kiln.runtime.quantization.gpu_bench``,
# docs/benchmarks.md); shapes or M not listed fall back to the heuristics of ``choose_config``.
TUNED: dict[tuple[int, int, int], dict] = {
    (6144, 4096, 1): {"KERNEL": "gemv2", "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 2048, "CHAIN": 8, "num_warps": 4, "num_stages": 1, "PREFETCH": 1, "SPLIT_K": 1},  # 7.46 us, 2.09x bf16 (session 9)
    (6144, 4096, 2): {"KERNEL": "gemv2", "BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 1024, "CHAIN": 8, "num_warps": 4, "num_stages": 1, "PREFETCH": 1, "SPLIT_K": 1},  # 9.06 us, 1.73x bf16 (session 9)
    (6144, 4096, 4): {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "PREFETCH": 1, "SPLIT_K": 8},  # 13.9 us, 1.13x bf16 (session 7)
    (6144, 4096, 8): {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 8},  # 14.2 us, 1.08x bf16 (session 7)
    (6144, 4096, 16): {"KERNEL": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 8},  # 14.2 us, 1.13x bf16
    (4096, 4096, 1): {"KERNEL": "gemv2", "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 2048, "CHAIN": 8, "num_warps": 4, "num_stages": 1, "PREFETCH": 1, "SPLIT_K": 1},  # 5.73 us, 2.31x bf16 (session 9)
    (4096, 4096, 2): {"KERNEL": "gemv2", "BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 2048, "CHAIN": 8, "num_warps": 4, "num_stages": 1, "PREFETCH": 1, "SPLIT_K": 1},  # 6.72 us, 1.96x bf16 (session 9)
    (4096, 4096, 4): {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 4},  # 10.8 us, 1.21x bf16 (session 7)
    (4096, 4096, 8): {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 4},  # 10.9 us, 1.20x bf16 (session 7)
    (4096, 4096, 16): {"KERNEL": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 4},  # 11.4 us, 1.17x bf16
    (28672, 4096, 1): {"KERNEL": "gemv2", "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 1024, "CHAIN": 8, "num_warps": 4, "num_stages": 1, "PREFETCH": 0, "SPLIT_K": 1},  # 19.88 us, 2.86x bf16 (session 9)
    (28672, 4096, 2): {"KERNEL": "gemv2", "BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 1024, "CHAIN": 8, "num_warps": 4, "num_stages": 1, "PREFETCH": 1, "SPLIT_K": 1},  # 24.5 us, 2.34x bf16 (session 9)
    (28672, 4096, 4): {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 1},  # 39.0 us, 1.64x bf16 (session 7)
    (28672, 4096, 8): {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 1},  # 39.1 us, 1.63x bf16 (session 7)
    (28672, 4096, 16): {"KERNEL": "swap", "BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 2},  # 40.7 us, 1.57x bf16
    (4096, 14336, 1): {"KERNEL": "gemv2", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 2048, "CHAIN": 8, "num_warps": 8, "num_stages": 1, "PREFETCH": 0, "SPLIT_K": 4},  # 12.86 us, 2.49x bf16 (session 9)
    (4096, 14336, 2): {"KERNEL": "gemv2", "BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 2048, "CHAIN": 8, "num_warps": 4, "num_stages": 1, "PREFETCH": 0, "SPLIT_K": 4},  # 15.26 us, 2.12x bf16 (session 9)
    (4096, 14336, 4): {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 8},  # 22.6 us, 1.49x bf16 (session 7)
    (4096, 14336, 8): {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 8},  # 22.7 us, 1.49x bf16 (session 7)
    (4096, 14336, 16): {"KERNEL": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, "SPLIT_K": 8},  # 25.1 us, 1.36x bf16
    # the LM head (``kiln build --quantize-lm-head``, float32 logits): 79.6 us, 3.53x bf16 cuBLAS
    # (281 us); the default config took 102 us (session 11)
    (128256, 4096, 1): {"KERNEL": "gemv2", "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 1024, "CHAIN": 8, "num_warps": 4, "num_stages": 1, "PREFETCH": 1, "SPLIT_K": 1},
}


# The same for weights stored K-major (``to_kmajor``; serving opt-in, ``KILN_W4A16_LAYOUT=kmajor``).
# H200 sweep of session 8 (``gpu_bench --only w4a16-kmajor --ms 1,2,4``, docs/benchmarks.md):
# the K-major GEMV wins at M = 1 (o 6.6 us vs gemv2's 6.9 on N-major, qkv equal, gate_up 27.6
# vs 22.6 and down 16.5 vs 14.1 slower: it issues ~2.5 instructions per weight and is issue-
# bound there), the swap kernel from M = 2 (faster than on N-major at M = 4: gate_up 31.0 vs 39.0).
_GT = {"KERNEL": "gemvt", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 2048, "num_warps": 2, "num_stages": 1, "SPLIT_K": 1}
_SW = {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PREFETCH": 1,
       "SPLIT_K": 4}
TUNED_KMAJOR: dict[tuple[int, int, int], dict] = {
    (6144, 4096, 1): dict(_GT),  # 8.24 us, 1.93x bf16
    (6144, 4096, 2): dict(_SW),  # 11.4 us, 1.34x
    (6144, 4096, 4): dict(_SW),  # 11.4 us, 1.33x
    (4096, 4096, 1): dict(_GT),  # 6.56 us, 2.02x
    (4096, 4096, 2): dict(_GT, BLOCK_M=2, BLOCK_K=4096, num_warps=4, SPLIT_K=4),  # 8.30 us, 1.58x
    (4096, 4096, 4): dict(_SW, num_stages=4),  # 9.15 us, 1.43x
    (28672, 4096, 1): dict(_GT),  # 27.6 us, 2.31x
    (28672, 4096, 2): dict(_SW),  # 30.6 us, 2.05x
    (28672, 4096, 4): dict(_SW, BLOCK_N=256, SPLIT_K=2),  # 31.0 us, 2.05x
    (4096, 14336, 1): dict(_GT, BLOCK_N=32, SPLIT_K=4),  # 16.5 us, 1.95x
    (4096, 14336, 2): dict(_SW, num_stages=4),  # 21.8 us, 1.49x
    (4096, 14336, 4): dict(_SW, num_stages=4),  # 21.9 us, 1.49x
}


def m_bucket(M: int) -> int:
    """The ``TUNED`` bucket of M (0 above 16)."""
    return 1 if M <= 1 else 2 if M == 2 else 4 if M <= 4 else 8 if M <= 8 else 16 if M <= 16 else 0

# GEMV kernel forced for M <= 4 when no config is given ("", "gemv" or "gemv2"; see
# ``choose_config``).  Benchmarks set it to time both kernels with the same callers; CUDA graphs
# keep the kernel chosen when they were captured.
SMALL_M_KERNEL = os.environ.get("KILN_W4A16_SMALL_M", "")

KERNELS = ("gemv", "gemv2", "gemvt", "mma", "swap", "dequant")


def early_fetch() -> bool:
    """Whether ``gemv2`` loads its first weight step before the programmatic-dependent-launch
    wait (``EARLY``; with PDL only, and it implies ``PREFETCH`` 1): ``KILN_W4A16_EARLY``
    (``0``/``1``, read at every launch) or the measured default ``EARLY_FETCH``.  A config's
    own ``EARLY`` key wins over both."""
    raw = os.environ.get("KILN_W4A16_EARLY", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"KILN_W4A16_EARLY must be 0 or 1, got {raw!r}")
    return EARLY_FETCH if raw == "" else raw == "1"


EARLY_FETCH = False  # measured: slower decode steps (gpu_bench --only early; session 11)


def fused_silu() -> bool:
    """Whether ``w4a16_gemm(..., silu_and_mul=True)`` may fuse SwiGLU into the ``gemv2``
    epilogue: ``KILN_W4A16_FUSED_SILU`` (``0``/``1``, read at every launch) or the measured
    default ``FUSED_SILU``."""
    raw = os.environ.get("KILN_W4A16_FUSED_SILU", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"KILN_W4A16_FUSED_SILU must be 0 or 1, got {raw!r}")
    return FUSED_SILU if raw == "" else raw == "1"


FUSED_SILU = True  # measured: a ~9 us (0.4 %) shorter batch-1 int4 decode step (session 11)
# From this M on (CUDA), ``choose_config`` dequantizes the weight and runs cuBLAS
# (``w4a16_dequant``).  H200, Llama-3.1-8B projections (docs/benchmarks.md, session 8): at
# M = 65 3.5x (qkv), 4.8x (o), 1.6x (gate_up), 5.0x (down) faster than the fused ``mma``
# kernel (whose M > 64 tiles are slow), at 2048 6.3-6.5x (1.2x bf16 cuBLAS); at M = 64 it
# wins on qkv and o (1.32x, 1.16x) and loses on gate_up and down (0.95x, 0.94x), so ``mma``
# keeps M <= 64, where its tiles are good.
def _env_min_m(name: str, default: int) -> int:
    """A positive integer from the environment; ValueError naming the variable otherwise."""
    raw = os.environ.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (rows from which int4 GEMMs dequantize and use cuBLAS), "
                         f"got {raw!r}")
    return value


DEQUANT_MIN_M = _env_min_m("KILN_W4A16_DEQUANT_MIN_M", 65)
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _use_asm(x: torch.Tensor) -> bool:
    """Inline PTX on a real GPU (not under the CPU interpreter)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _gemv2_x(x: torch.Tensor) -> torch.Tensor:
    """x as int64 words [M, K / 4] (four float16/bfloat16; a view, no copy, for row-major x).
    float32 x (tests) is rounded to float16 first; other layouts are copied."""
    if x.dtype == torch.float32:
        x = x.to(torch.float16)
    if x.stride(1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8:
        x = x.contiguous()
    return x.view(torch.int64)


def is_kmajor(qweight: torch.Tensor) -> bool:
    """True when the packed weight ``[K // 8, N]`` is stored K-major (strides ``(1, K // 8)``,
    ``to_kmajor``): each column's packed rows contiguous."""
    return qweight.dim() == 2 and qweight.shape[1] > 1 and qweight.stride(0) == 1


def to_kmajor(t: torch.Tensor) -> torch.Tensor:
    """The same ``[R, N]`` values stored column by column (strides ``(1, R)``): for
    ``qweight``, ``scales`` and ``qzeros`` the layout ``w4a16_gemvt`` streams (every kernel
    takes any strides).  A copy; ``.contiguous()`` gives the checkpoint layout back."""
    return t.t().contiguous().t()


def choose_config(M: int, N: int, K: int, group_size: int, device: torch.device,
                  dtype: torch.dtype | None = None, kernel: str | None = None, kmajor: bool = False) -> dict:
    """Kernel, tile sizes, warps, stages and split-K for a problem.

    ``kmajor`` (the weights are stored K-major, ``to_kmajor``): ``TUNED_KMAJOR`` first, and the
    K-major GEMV ``gemvt`` (``w4a16_gemvt``) for M <= 4 with float16/bfloat16 x and groups of
    32k.  Otherwise ``TUNED`` first (H200 sweep).  Then: M <= 2, a CUDA-core GEMV kernel with enough K
    splits to fill the GPU (the packed-half ``gemv2`` for float16/bfloat16 x and groups of 32k:
    narrow 32-64 column tiles and 1024-wide K steps, what won on all four 8B projections in the
    session-7 sweep, about two programs per SM; else the float32 ``gemv``: 64 x 128 tiles,
    about four programs per SM); 2 < M <=
    16 with float16/bfloat16 x and groups of 64k, the swap-AB tensor-core kernel
    (``w4a16_swap``); M <= 64, the tensor-core kernel with x as the A operand and a 16-row
    tile, same split rule; from ``DEQUANT_MIN_M`` (65) rows on CUDA, the weight dequantized
    to x's dtype and a cuBLAS GEMM (``w4a16_dequant``; elsewhere larger M gets 128 x 128
    tiles without a split).  Under the CPU interpreter: small tiles.

    ``kernel`` ("gemv", "gemv2" or "gemvt"; default ``SMALL_M_KERNEL``) forces the GEMV kernel
    for M <= 4: the table's entry if it is that kernel, else that kernel's default.  ``gemv2``
    and ``gemvt`` fall back to ``gemv`` where they do not apply (float32 x, G % 32 != 0).
    """
    if kernel not in (None, "", "gemv", "gemv2", "gemvt"):
        raise ValueError(f"the forced small-M kernel (KILN_W4A16_SMALL_M) must be gemv, gemv2 or gemvt, "
                         f"got {kernel!r}")
    kernel = kernel or None
    gemv2_ok = dtype in (torch.float16, torch.bfloat16) and group_size % 32 == 0 and M <= 4
    if kernel in ("gemv2", "gemvt") and not gemv2_ok:
        kernel = "gemv"
    if kernel is not None and M > 4:
        kernel = None
    tuned = (TUNED_KMAJOR if kmajor else TUNED).get((N, K, m_bucket(M)))
    if tuned is not None and tuned["KERNEL"] in ("gemv2", "gemvt") and not gemv2_ok:
        tuned = None  # measured for float16/bfloat16 x and groups of 32k only
    half = dtype in (torch.float16, torch.bfloat16)
    if tuned is not None and tuned["KERNEL"] == "swap" and not (half and group_size % tuned["BLOCK_K"] == 0):
        tuned = None  # the swap kernel needs float16/bfloat16 x and whole groups per step
    if tuned is not None and device.type == "cuda" and kernel in (None, tuned["KERNEL"]):
        return dict(tuned)
    if kernel is None and M >= DEQUANT_MIN_M and device.type == "cuda":  # compute-bound: cuBLAS on a dequantized copy
        return {"KERNEL": "dequant", "BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 8,
                "num_stages": 1}
    if kernel is None and kmajor and M <= 4 and gemv2_ok:
        kernel = "gemvt"
    if kernel is None and M <= 2:
        kernel = "gemv2" if gemv2_ok else "gemv"
    bm = min(4, max(1, triton.next_power_of_2(M)))
    bk = 128 if group_size % 128 == 0 else 64
    if device.type != "cuda":
        if kernel in ("gemv2", "gemvt"):
            return {"KERNEL": kernel, "BLOCK_M": bm, "BLOCK_N": 16 if kernel == "gemv2" else 4, "BLOCK_K": 128,
                    "CHAIN": 8, "SPLIT_K": 2 if K >= 512 else 1, "num_warps": 1, "num_stages": 1}
        return {"KERNEL": "gemv" if M <= 4 else "mma", "BLOCK_M": min(16, max(1, triton.next_power_of_2(M))),
                "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2 if K >= 512 else 1, "num_warps": 1, "num_stages": 1}
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def split_for(tiles: int, bk: int = bk, programs: int = 4 * sms, min_steps: int = 4) -> int:
        split = 1
        while tiles * split < programs and K // (split * 2) >= min_steps * bk and split < 16:
            split *= 2
        return split

    if kernel == "gemvt":  # one 64-column block per thread and step, about four programs per SM
        bn, bk2 = 8, min(1024, max(128, triton.next_power_of_2(K) // 4))
        return {"KERNEL": "gemvt", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk2, "CHAIN": 8,
                "SPLIT_K": split_for(triton.cdiv(N, bn), bk2, 4 * sms, 1), "num_warps": 4, "num_stages": 1}
    if kernel == "gemv2":  # H200 winners (session 7): narrow column tiles, long K steps, ~2 programs per SM
        bn, bk2, warps = (64, 1024, 8) if M == 1 else (32, 1024, 4)
        bk2 = min(bk2, max(256, triton.next_power_of_2(K) // 4))
        return {"KERNEL": "gemv2", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk2, "CHAIN": 8,
                "SPLIT_K": split_for(triton.cdiv(N, bn), bk2, 2 * sms, 1), "num_warps": warps, "num_stages": 1}
    if kernel == "gemv":  # H200: the GEMV kernel wins at M = 1, 2, the tensor-core one from M = 4
        return {"KERNEL": "gemv", "BLOCK_M": triton.next_power_of_2(M), "BLOCK_N": 64, "BLOCK_K": bk,
                "SPLIT_K": split_for(triton.cdiv(N, 64)), "num_warps": 4, "num_stages": 2}
    if 2 < M <= 16 and half and group_size % 64 == 0:  # H200: the swap kernel wins from M = 4 (gemv2 below)
        bk = 128 if group_size % 128 == 0 else 64
        return {"KERNEL": "swap", "BLOCK_M": 8 if M <= 8 else 16, "BLOCK_N": 128, "BLOCK_K": bk, "PREFETCH": 1,
                "SPLIT_K": split_for(triton.cdiv(N, 128), bk), "num_warps": 4, "num_stages": 3}
    if M <= 64:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        return {"KERNEL": "mma", "BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 128,
                "SPLIT_K": split_for(triton.cdiv(N, 128) * triton.cdiv(M, bm)), "num_warps": 4, "num_stages": 2}
    return {"KERNEL": "mma", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8,
            "num_stages": 3}


def _check_config(cfg: dict) -> None:
    """ValueError unless ``cfg`` names a kernel and has the launch keys it needs: power-of-two
    tile sizes, ``SPLIT_K`` / ``num_stages`` >= 1, 1-16 warps."""
    if cfg.get("KERNEL") not in KERNELS:
        raise ValueError(f"config KERNEL must be one of {', '.join(KERNELS)}, got {cfg.get('KERNEL')!r}")
    need = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"]
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"config for the {cfg['KERNEL']} kernel lacks {', '.join(missing)}")
    bad = [k for k in need if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1]
    bad += [k for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")
            if k not in bad and (cfg[k] & (cfg[k] - 1) or (k == "num_warps" and cfg[k] > 16))]
    if bad:
        raise ValueError("config " + ", ".join(f"{k}={cfg[k]!r}" for k in bad) + ": tile sizes and num_warps must "
                         "be powers of two (num_warps <= 16), SPLIT_K and num_stages integers >= 1")


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               config: dict | None = None, out_dtype: torch.dtype | None = None,
               silu_and_mul: bool = False) -> torch.Tensor:
    """``x`` [M, K] (float16/bfloat16/float32) times the int4 weight -> [M, N] in ``out_dtype``.

    With ``silu_and_mul`` the weight is a fused gate|up projection ``[2I, K]`` and the result
    is ``silu(y[:, :I]) * y[:, I:]``, ``[M, I]`` (SwiGLU, as ``kiln.kernels.activation``): in
    the ``gemv2`` kernel's epilogue, from its float32 sums, when the launch is ``gemv2`` without
    a K split (``fused_silu()``; the decode GEMVs at M = 1, 2), else the GEMM then
    ``activation.silu_and_mul``.  The fused form saves the SiLU kernel, its launch and the
    ``[M, 2I]`` round trip, and rounds once (the unfused form rounds y to ``out_dtype`` first).

    Args:
        x: activations, any 2-D strides.
        qweight: int32 [K // 8, N]; scales: float [K // G, N]; qzeros: uint8 [K // G, N]; any
            strides (K-major storage, ``to_kmajor``, selects ``TUNED_KMAJOR`` and ``gemvt``).
        config: override ``choose_config``'s launch choice (benchmarks, tests).
        out_dtype: float16, bfloat16 or float32 (default ``x.dtype``); the kernels round their
            float32 accumulators to it when they store (float32: logits of a quantized LM head).
    Raises:
        ValueError: shapes or dtypes that do not fit the format, a bad ``out_dtype``, or a
            ``config`` that names no kernel, lacks launch keys or has tiles that are not powers
            of two; ``silu_and_mul`` with an odd N.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if qweight.dim() != 2 or scales.dim() != 2 or qzeros.dim() != 2:
        raise ValueError(f"qweight, scales and qzeros must be 2-D, got {tuple(qweight.shape)}, "
                         f"{tuple(scales.shape)}, {tuple(qzeros.shape)}")
    M, K = x.shape
    K8, N = qweight.shape
    if K == 0 or N == 0:
        raise ValueError(f"empty weight: K={K}, N={N}")
    if not scales.dtype.is_floating_point or scales.dtype.itemsize > 4 or qzeros.dtype != torch.uint8:
        raise ValueError(f"scales must be float16/bfloat16/float32 and qzeros uint8, got {scales.dtype} / "
                         f"{qzeros.dtype}")
    if qweight.dtype != torch.int32 or K8 * 8 != K or K % KBLOCK:
        raise ValueError(f"qweight must be int32 [K/8={K // 8}, N] with K % {KBLOCK} == 0, "
                         f"got {qweight.dtype} {tuple(qweight.shape)} for K={K}")
    if scales.shape != qzeros.shape or scales.shape[1] != N or K % scales.shape[0]:
        raise ValueError(f"scales/qzeros must be [K/G, N={N}], got {tuple(scales.shape)} / {tuple(qzeros.shape)}")
    if x.dtype not in _TL:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in _TL:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    G = K // scales.shape[0]
    if G % 8:
        raise ValueError(f"group size {G} must be a multiple of 8")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    cfg = dict(config or choose_config(M, N, K, G, x.device, x.dtype, SMALL_M_KERNEL or None,
                                       kmajor=is_kmajor(qweight)))
    _check_config(cfg)
    bk = cfg["BLOCK_K"]
    if bk % KBLOCK or (cfg["KERNEL"] == "mma" and bk < 128):
        raise ValueError(f"BLOCK_K {bk} must be a multiple of {KBLOCK} (and >= 128 for the mma kernel)")
    if cfg["KERNEL"] in ("gemv2", "gemvt") and (G % 32 or cfg["BLOCK_M"] > 4):
        raise ValueError(f"the {cfg['KERNEL']} kernel needs G % 32 == 0 and BLOCK_M <= 4, got G={G}, "
                         f"BLOCK_M={cfg['BLOCK_M']}")
    if cfg["KERNEL"] == "swap" and (G % bk or x.dtype == torch.float32 or cfg["BLOCK_M"] < 8):
        raise ValueError(f"the swap kernel needs float16/bfloat16 x, G % BLOCK_K == 0 and BLOCK_M >= 8, got "
                         f"{x.dtype}, G={G}, BLOCK_K={bk}, BLOCK_M={cfg['BLOCK_M']}")
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(K, bk)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    gated = False
    if silu_and_mul:
        if N % 2:
            raise ValueError(f"silu_and_mul needs a gate|up weight with an even N, got N={N}")
        if not (cfg["KERNEL"] == "gemv2" and split == 1 and cfg["BLOCK_N"] >= 4 and fused_silu()):
            from .activation import silu_and_mul as _silu_and_mul  # noqa: PLC0415

            return _silu_and_mul(w4a16_gemm(x, qweight, scales, qzeros, cfg, out_dtype))
        gated = True  # the gemv2 epilogue writes silu(gate) * up: N // 2 columns, BLOCK_N // 2 per tile
    n_out = N // 2 if gated else N
    tile_n = cfg["BLOCK_N"] // 2 if gated else cfg["BLOCK_N"]
    grid = (triton.cdiv(n_out, tile_n), triton.cdiv(M, cfg["BLOCK_M"]), split)
    out = torch.empty((M, n_out), dtype=out_dtype, device=x.device)
    if split > 1:
        part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, grid[0] * grid[1])
    else:
        part = cnt = out
    if cfg["KERNEL"] == "gemv2":
        xw = _gemv2_x(x)
        pdl = launch_kwargs(x.device)
        early = bool(pdl["PDL"]) and bool(cfg.get("EARLY", early_fetch()))
        _gemv2_kernel[grid](xw, qweight, scales, qzeros, out, part, cnt, M, n_out, K, k_per_split, split,
                            xw.stride(0), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
                            qzeros.stride(0), qzeros.stride(1), out.stride(0), out.stride(1),
                            GROUP_SIZE=G, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
                            CHAIN=cfg.get("CHAIN", 8), HAS_SPLIT=split > 1, NUM_STAGES=cfg["num_stages"],
                            X_BF16=x.dtype == torch.bfloat16, ASM=_use_asm(x), EVEN_K=K % bk == 0,
                            EVEN_N=n_out % tile_n == 0, EVEN_M=M % cfg["BLOCK_M"] == 0,
                            PREFETCH=1 if early else cfg.get("PREFETCH", 0), EARLY=early, GATED=gated,
                            num_warps=cfg["num_warps"], **pdl)
        return out
    if cfg["KERNEL"] == "dequant":  # large M: dequantize once, then a dense GEMM (cuBLAS on CUDA)
        from .w4a16_dequant import dequantize  # noqa: PLC0415

        w = dequantize(qweight, scales, qzeros, x.dtype, cfg["BLOCK_N"], bk, cfg["num_warps"])
        if out_dtype != x.dtype:
            return torch.matmul(x, w.t()).to(out_dtype)
        return torch.matmul(x, w.t(), out=out)
    if cfg["KERNEL"] == "gemvt":
        from .w4a16_gemvt import _gemvt_kernel  # noqa: PLC0415

        xw = _gemv2_x(x)
        _gemvt_kernel[grid](xw, qweight, scales, qzeros, out, part, cnt, M, N, K, k_per_split // 8, split,
                            xw.stride(0), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
                            qzeros.stride(0), qzeros.stride(1), out.stride(0), out.stride(1),
                            GROUP_SIZE=G, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
                            HAS_SPLIT=split > 1, X_BF16=x.dtype == torch.bfloat16, ASM=_use_asm(x),
                            EVEN_K=K % bk == 0, EVEN_M=M % cfg["BLOCK_M"] == 0,
                            num_warps=cfg["num_warps"], **launch_kwargs(x.device))
        return out
    args = (x, qweight, scales, qzeros, out, part, cnt, M, N, K, k_per_split, split,
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
            qzeros.stride(0), qzeros.stride(1), out.stride(0), out.stride(1))
    meta = dict(GROUP_SIZE=G, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, HAS_SPLIT=split > 1,
                NUM_STAGES=cfg["num_stages"], ASM=_use_asm(x), num_warps=cfg["num_warps"])
    if cfg["KERNEL"] == "swap":
        from .w4a16_swap import _swap_kernel  # (imports ``_finish`` from here)

        _swap_kernel[grid](*args, **meta, X_F16=x.dtype == torch.float16, EVEN_N=N % cfg["BLOCK_N"] == 0,
                           PREFETCH=cfg.get("PREFETCH", 0))
    elif cfg["KERNEL"] == "gemv":
        _gemv_kernel[grid](*args, **meta, **launch_kwargs(x.device))
    else:
        _mma_kernel[grid](*args, **meta, DOT_DTYPE=_TL[x.dtype],
                          DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", **launch_kwargs(x.device))
    return out
