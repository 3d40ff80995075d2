"""W4A16 GEMM: ``y = x @ W^T`` with ``W`` stored as packed int4 (AWQ/GPTQ format) and ``x`` in
float16/bfloat16 (float32 too, for tests), dequantized in registers.

Weight format (Kiln's ``quantization.int4``; ``W`` is [N, K], group size ``G``):

* ``qweight`` int32 ``[K // 8, N]``: bits ``4i..4i+3`` of ``qweight[j, n]`` hold the code of
  ``W[n, 8j + i]`` (0..15);
* ``scales`` float ``[K // G, N]``, ``qzeros`` uint8 ``[K // G, N]``;
* ``W[n, k] = (code - qzeros[k // G, n]) * scales[k // G, n]``.

Kernel: each program computes a ``BLOCK_M x BLOCK_N`` tile of ``y`` over a range of K.  Per
``BLOCK_K`` step it loads the x tile, the packed words (each int32 row serves 8 K rows, the
``k // 8`` gather hits the same cache line), shifts/masks the nibbles, applies the group's
scale and zero point (``BLOCK_K`` divides ``G``: one group per step) and feeds ``tl.dot``.
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
    DOT_DTYPE: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // grid_n
    pid_n = pid_mn % grid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        packed = tl.load(qw_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=mask_k[:, None] & mask_n[None, :], other=0)
        codes = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0).to(tl.float32)
        w = ((codes.to(tl.float32) - z[None, :]) * s[None, :]).to(DOT_DTYPE)
        acc += tl.dot(x.to(DOT_DTYPE), w)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


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
    bk = min(group_size, 128)
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": min(bk, 32), "SPLIT_K": 2 if K >= 4 * min(bk, 32) else 1,
                "num_warps": 1, "num_stages": 1}
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if M <= 16:
        bm, bn = 16, 64
        tiles = triton.cdiv(N, bn)
        split = 1
        while tiles * split * 2 <= 2 * sms and K // (split * 2) >= 2 * bk:
            split *= 2
        return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": 4}
    if M <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": min(bk, 64), "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": min(bk, 64), "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}


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
    if G % bk:
        raise ValueError(f"BLOCK_K {bk} must divide the group size {G}")
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
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split == 1:
        return out[0]
    return out.sum(dim=0).to(x.dtype)
