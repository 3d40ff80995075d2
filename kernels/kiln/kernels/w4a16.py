"""W4A16 GEMM: ``y = x @ W^T`` with ``W`` stored as packed int4 (AWQ/GPTQ format) and ``x`` in
float16/bfloat16 (float32 too, for tests), dequantized in registers.

Weight format (Kiln's ``quantization.int4``; ``W`` is [N, K], group size ``G``):

* ``qweight`` int32 ``[K // 8, N]``: bits ``4i..4i+3`` of ``qweight[j, n]`` hold the code of
  ``W[n, 8j + i]`` (0..15);
* ``scales`` float ``[K // G, N]``, ``qzeros`` uint8 ``[K // G, N]``;
* ``W[n, k] = (code - qzeros[k // G, n]) * scales[k // G, n]``.

Kernel: each program computes a ``BLOCK_M x BLOCK_N`` tile of ``y`` over a range of K.  Per
``BLOCK_K`` step it loads the packed words once (``[BLOCK_K / 8, BLOCK_N]`` int32), and for
each of the 8 nibbles turns the codes into floats with the ``2**23`` magic number (OR into a
float32's mantissa: no slow int-to-float conversion), applies the group's zero point and
scale (one row of them when ``BLOCK_K <= G``, one per packed row otherwise) and feeds
``tl.dot`` with the x columns ``k0 + 8 j + i`` (eight products of depth ``BLOCK_K / 8``, no
register reshuffle).
For small M (decode: 1..16 rows) the weight read is the whole cost and N / BLOCK_N tiles do
not fill the GPU, so K is split over ``SPLIT_K`` programs that write float32 partial sums,
added afterwards (split-K; deterministic, no atomics).  Launch choices live in
``choose_config`` (measured numbers in docs/benchmarks.md, "Quantization").

``w4a16_ref`` is the torch reference (dequantize, then matmul in float32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["w4a16_gemm", "w4a16_ref", "dequantize_ref", "choose_config"]


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    """float32 ``W`` [N, K] from the packed format (torch reference)."""
    K8, N = qweight.shape
    shifts = (torch.arange(8, dtype=torch.int32, device=qweight.device) * 4).view(1, 8, 1)
    codes = ((qweight.unsqueeze(1) >> shifts) & 0xF).reshape(K8 * 8, N).float()  # [K, N]
    G = (K8 * 8) // scales.shape[0]
    s = scales.float().repeat_interleave(G, dim=0)
    z = qzeros.float().repeat_interleave(G, dim=0)
    return ((codes - z) * s).t().contiguous()


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    """Reference ``x`` [M, K] @ dequant(W)^T -> [M, N] in ``x.dtype`` (float32 math)."""
    return (x.float() @ dequantize_ref(qweight, scales, qzeros).t()).to(x.dtype)


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_os, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // grid_n
    pid_n = pid_mn % grid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 8)  # packed rows of one step
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # one load of the packed words: [BLOCK_K / 8, BLOCK_N] int32
        rows = k0 // 8 + offs_j
        mask_j = rows < K // 8
        packed = tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=mask_j[:, None] & mask_n[None, :], other=0)
        # zero points are offset by 2**23: the codes below are 2**23 + q (float32 magic number,
        # an OR into the mantissa instead of a slow int->float conversion)
        if BLOCK_K <= GROUP_SIZE:  # one group per step: one row of scales
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            zf = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0).to(tl.float32)[None, :]
        else:  # several groups per step: the group of packed row j (8 | GROUP_SIZE)
            g = (rows * 8) // GROUP_SIZE
            m2 = mask_j[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=m2, other=0.0).to(tl.float32)
            zf = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=m2, other=0).to(tl.float32)
        zf = zf + 8388608.0
        # nibble i of word j is K row k0 + 8 j + i: eight products of depth BLOCK_K / 8
        for i in tl.static_range(8):
            codes = ((packed >> (4 * i)) & 0xF) | 0x4B000000
            w = ((codes.to(tl.float32, bitcast=True) - zf) * s).to(DOT_DTYPE)
            offs_k = rows * 8 + i
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_j[None, :], other=0.0)
            acc += tl.dot(x.to(DOT_DTYPE), w, input_precision=DOT_PREC)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Measured best launch configs: (N, K, M bucket 16 | 64 | 0) -> config.  Filled by the
# benchmark's sweep (kiln.runtime.quantization.gpu_bench) or by hand from docs/benchmarks.md.
TUNED: dict[tuple[int, int, int], dict] = {}

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_config(M: int, N: int, K: int, group_size: int, device: torch.device) -> dict:
    """Tile sizes, warps, stages and split-K for a problem (heuristics, see module doc).

    Small M: BLOCK_M 16, BLOCK_N 64, and enough K splits that tiles x splits reach about two
    programs per SM (each split at least two BLOCK_K steps).  Larger M: 64/128 x 128 tiles,
    no split.  Under the CPU interpreter: the smallest tiles.
    """
    bk = 128  # tl.dot needs depth >= 16 per nibble: BLOCK_K / 8 >= 16
    tuned = TUNED.get((N, K, 16 if M <= 16 else 64 if M <= 64 else 0))
    if tuned is not None and device.type == "cuda":
        return dict(tuned)
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": bk, "SPLIT_K": 2 if K >= 4 * bk else 1,
                "num_warps": 1, "num_stages": 1}
    if M <= 16:
        # H200 sweep (BLOCK_N 64/128, split 1/2/4/8, 4 or 8 warps; docs/benchmarks.md): BLOCK_N 128,
        # split 8, 4 warps, 3 stages won on all four Llama-3.1-8B shapes, e.g. gate_up (28672 x
        # 4096) M=1: 59.1 us (1071 GB/s of int4) vs 114 us for the first kernel (BLOCK_N 64,
        # split 2, k // 8 gather loads, int->float conversions).
        split = 1
        while split < 8 and K // (split * 2) >= 2 * bk:
            split *= 2
        return {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}
    if M <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               config: dict | None = None) -> torch.Tensor:
    """``x`` [M, K] (float16/bfloat16/float32) times the int4 weight -> [M, N] in ``x.dtype``.

    Args:
        x: activations, any 2-D strides.
        qweight: int32 [K // 8, N]; scales: float [K // G, N]; qzeros: uint8 [K // G, N].
        config: override ``choose_config``'s launch choice (benchmarks).
    Raises:
        ValueError: shapes or dtypes that do not fit the format.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    K8, N = qweight.shape
    if qweight.dtype != torch.int32 or K8 * 8 != K:
        raise ValueError(f"qweight must be int32 [K/8={K // 8}, N], got {qweight.dtype} {tuple(qweight.shape)}")
    if scales.shape != qzeros.shape or scales.shape[1] != N or K % scales.shape[0]:
        raise ValueError(f"scales/qzeros must be [K/G, N={N}], got {tuple(scales.shape)} / {tuple(qzeros.shape)}")
    if x.dtype not in _TL:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    G = K // scales.shape[0]
    cfg = dict(config or choose_config(M, N, K, G, x.device))
    bk = cfg["BLOCK_K"]
    if G % 8 or (bk % G and G % bk) or bk < 128:
        raise ValueError(f"group size {G} must be a multiple of 8 and BLOCK_K {bk} (>= 128) a multiple or divisor of it")
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(K, bk)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    if split == 1:
        out = torch.empty((1, M, N), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), split)
    _w4a16_kernel[grid](
        x, qweight, scales, qzeros, out, M, N, K, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        qzeros.stride(0), qzeros.stride(1), out.stride(0), out.stride(1), out.stride(2),
        GROUP_SIZE=G, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, DOT_DTYPE=_TL[x.dtype],
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split == 1:
        return out[0]
    return out.sum(dim=0).to(x.dtype)
