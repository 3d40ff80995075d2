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

Two kernels:

* ``_gemv_kernel`` (small M, no tensor cores): a ``[BLOCK_M, BLOCK_K / 8, BLOCK_N]`` tile of
  FMAs per nibble into per-row accumulators, reduced over the rows once at the end.  At
  M = 1 the weight stream is the whole cost: it needs about 3 instructions per weight.
* ``_mma_kernel`` (larger M): eight ``tl.dot`` of depth ``BLOCK_K / 8`` per step on the same
  ``f`` values (exact in bf16/fp16), group correction on the fp32 dot result.

Both split K over ``SPLIT_K`` programs for small M (N / BLOCK_N tiles alone do not fill 132
SMs).  The split reduction is in the same launch (kernels run inside CUDA graphs, where each
extra launch costs microseconds): every program writes its float32 partial tile, bumps a
per-tile counter, and the last one to arrive adds the partials, writes ``y`` and resets the
counter to zero for the next launch.  Launch choices live in ``choose_config`` and ``TUNED``
(measured numbers in docs/benchmarks.md, "GPU (H200)").

``dequantize_ref`` / ``w4a16_ref`` are the torch reference (dequantize, then matmul in
float32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["w4a16_gemm", "w4a16_ref", "dequantize_ref", "choose_config", "m_bucket", "TUNED", "KBLOCK"]

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
def _finish(y, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k, tile, SPLIT_K,
            HAS_SPLIT: tl.constexpr):
    """Store the [BLOCK_M, BLOCK_N] result, or (split-K) the partial, and let the last split of
    the tile add them up (float32 partials ``[SPLIT_K, M, N]``, per-tile arrival counter)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if not HAS_SPLIT:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, y, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for s in range(SPLIT_K):
                if s != pid_k:
                    y += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, ASM: tl.constexpr,
):
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


@triton.jit
def _mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, ASM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
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
    (6144, 4096, 1): {"KERNEL": "gemv", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (6144, 4096, 2): {"KERNEL": "gemv", "BLOCK_M": 2, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 4},
    (6144, 4096, 4): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (6144, 4096, 8): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (6144, 4096, 16): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (4096, 4096, 1): {"KERNEL": "gemv", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (4096, 4096, 2): {"KERNEL": "gemv", "BLOCK_M": 2, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (4096, 4096, 4): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (4096, 4096, 8): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (4096, 4096, 16): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 8},
    (28672, 4096, 1): {"KERNEL": "gemv", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 4},
    (28672, 4096, 2): {"KERNEL": "gemv", "BLOCK_M": 2, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 2},
    (28672, 4096, 4): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 2},
    (28672, 4096, 8): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 2},
    (28672, 4096, 16): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 2},
    (4096, 14336, 1): {"KERNEL": "gemv", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 8},
    (4096, 14336, 2): {"KERNEL": "gemv", "BLOCK_M": 2, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 8},
    (4096, 14336, 4): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 16},
    (4096, 14336, 8): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 16},
    (4096, 14336, 16): {"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "SPLIT_K": 16},
}


def m_bucket(M: int) -> int:
    """The ``TUNED`` bucket of M (0 above 16)."""
    return 1 if M <= 1 else 2 if M == 2 else 4 if M <= 4 else 8 if M <= 8 else 16 if M <= 16 else 0

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_NUM_COUNTERS = 1 << 16


def _use_asm(x: torch.Tensor) -> bool:
    """Inline PTX on a real GPU (not under the CPU interpreter)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for split-K tiles (each launch leaves them zero again).

    One buffer per device, shared by all launches: launches on one stream run one after the
    other, and each resets the counters it used before it ends."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, _NUM_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def choose_config(M: int, N: int, K: int, group_size: int, device: torch.device) -> dict:
    """Kernel, tile sizes, warps, stages and split-K for a problem.

    ``TUNED`` first (H200 sweep).  Otherwise: M <= 2, the CUDA-core GEMV kernel with a 64-column
    tile and enough K splits for about four programs per SM (the sweep's winners: 64 x 128,
    split 4-8); M <= 64, the tensor-core kernel with a 16-row tile and the same split rule;
    larger M, 128 x 128 tiles without a split.  Under the CPU interpreter: small tiles.
    """
    tuned = TUNED.get((N, K, m_bucket(M)))
    if tuned is not None and device.type == "cuda":
        return dict(tuned)
    bk = 128 if group_size % 128 == 0 else 64
    if device.type != "cuda":
        return {"KERNEL": "gemv" if M <= 4 else "mma", "BLOCK_M": min(16, max(1, triton.next_power_of_2(M))),
                "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2 if K >= 512 else 1, "num_warps": 1, "num_stages": 1}
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def split_for(tiles: int) -> int:
        split = 1
        while tiles * split < 4 * sms and K // (split * 2) >= 4 * bk and split < 16:
            split *= 2
        return split

    if M <= 2:  # H200: the GEMV kernel wins at M = 1, 2, the tensor-core one from M = 4
        return {"KERNEL": "gemv", "BLOCK_M": M, "BLOCK_N": 64, "BLOCK_K": bk,
                "SPLIT_K": split_for(triton.cdiv(N, 64)), "num_warps": 4, "num_stages": 2}
    if M <= 64:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        return {"KERNEL": "mma", "BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 128,
                "SPLIT_K": split_for(triton.cdiv(N, 128) * triton.cdiv(M, bm)), "num_warps": 4, "num_stages": 2}
    return {"KERNEL": "mma", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8,
            "num_stages": 3}


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               config: dict | None = None) -> torch.Tensor:
    """``x`` [M, K] (float16/bfloat16/float32) times the int4 weight -> [M, N] in ``x.dtype``.

    Args:
        x: activations, any 2-D strides.
        qweight: int32 [K // 8, N]; scales: float [K // G, N]; qzeros: uint8 [K // G, N].
        config: override ``choose_config``'s launch choice (benchmarks, tests).
    Raises:
        ValueError: shapes or dtypes that do not fit the format.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    K8, N = qweight.shape
    if qweight.dtype != torch.int32 or K8 * 8 != K or K % KBLOCK:
        raise ValueError(f"qweight must be int32 [K/8={K // 8}, N] with K % {KBLOCK} == 0, "
                         f"got {qweight.dtype} {tuple(qweight.shape)} for K={K}")
    if scales.shape != qzeros.shape or scales.shape[1] != N or K % scales.shape[0]:
        raise ValueError(f"scales/qzeros must be [K/G, N={N}], got {tuple(scales.shape)} / {tuple(qzeros.shape)}")
    if x.dtype not in _TL:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    G = K // scales.shape[0]
    if G % 8:
        raise ValueError(f"group size {G} must be a multiple of 8")
    cfg = dict(config or choose_config(M, N, K, G, x.device))
    bk = cfg["BLOCK_K"]
    if bk % KBLOCK or (cfg["KERNEL"] == "mma" and bk < 128):
        raise ValueError(f"BLOCK_K {bk} must be a multiple of {KBLOCK} (and >= 128 for the mma kernel)")
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(K, bk)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]), split)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, grid[0] * grid[1])
    else:
        part = cnt = out
    args = (x, qweight, scales, qzeros, out, part, cnt, M, N, K, k_per_split, split,
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
            qzeros.stride(0), qzeros.stride(1), out.stride(0), out.stride(1))
    meta = dict(GROUP_SIZE=G, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, HAS_SPLIT=split > 1,
                NUM_STAGES=cfg["num_stages"], ASM=_use_asm(x), num_warps=cfg["num_warps"])
    if cfg["KERNEL"] == "gemv":
        _gemv_kernel[grid](*args, **meta)
    else:
        _mma_kernel[grid](*args, **meta, DOT_DTYPE=_TL[x.dtype],
                          DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32")
    return out
