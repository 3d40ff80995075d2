"""LoRA shrink over token segments in Triton: ``h[t] = x[t] @ A[slot(t)].T`` (float32).

Grid: (token blocks of a segment, rank blocks, slots x K splits).  Each program reads its
slot's token count and returns at once past it, so the grid depends only on ``T``, ``S`` and
``K`` (fixed for a CUDA graph) while the work follows the step's adapters.

Split-K: a decode step gives each slot a few tokens, so without splitting only ``S x rank
blocks`` programs would walk the whole ``K`` (4096-14336) one after the other.  The input
dimension is split so that a few hundred programs run; each adds its partial product into
the zeroed float32 output with an atomic add (the order of those adds, hence the last bits of
``h``, may differ between runs on a GPU; the CPU interpreter runs them in order).  Punica's
SGMV shrink (Chen et al., 2023) and vLLM's ``lora_shrink_op`` split ``K`` the same way.
Reference: ``reference.lora_shrink_ref`` (rows without an adapter are zero there; here they
are left untouched and ``lora_shrink`` zeroes the output first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import check, check_last_dim_contiguous, interpreting

__all__ = ["lora_shrink"]

#: Programs a shrink aims for (an H200 has 132 SMs; a few programs per SM hide latency).
TARGET_PROGRAMS = 512
#: Fewest ``BLOCK_K`` steps a split walks (fewer: the atomic adds and the launch dominate).
MIN_K_STEPS_PER_SPLIT = 2


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ptr, counts_ptr, starts_ptr, K, R, K_PER_SPLIT,
                        stride_xm, stride_as, stride_ar, stride_om, SPLIT_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    slot = tl.program_id(2) // SPLIT_K
    split = tl.program_id(2) % SPLIT_K
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tok = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None], mask=mask_k[:, None] & mask_r[None, :],
                     other=0.0)  # [BLOCK_K, BLOCK_R]
        if IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    out_ptrs = out_ptr + tok[:, None] * stride_om + offs_r[None, :]
    mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask)


def shrink_blocks(T: int, K: int, R: int, S: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K)`` for a shrink of ``T`` tokens, ``K`` inputs,
    rank ``R`` (all parts) and ``S`` slots.  ``SPLIT_K`` grows until about
    ``TARGET_PROGRAMS`` programs can work (counting each slot's token blocks), each split
    keeping at least ``MIN_K_STEPS_PER_SPLIT`` steps of ``BLOCK_K``."""
    if interpreting():  # small blocks; the split still follows K, so the atomic path runs too
        block_m, block_r, block_k = 16, max(16, triton.next_power_of_2(R)), 32
    else:
        block_m = 16 if T <= 16 else 32 if T <= 64 else 64
        block_r = min(64, max(16, triton.next_power_of_2(R)))
        block_k = 64
    working = (triton.cdiv(T, block_m) + S) * triton.cdiv(R, block_r)  # token blocks that hold tokens
    max_split = max(1, triton.cdiv(K, block_k * MIN_K_STEPS_PER_SPLIT))
    split_k = max(1, min(max_split, TARGET_PROGRAMS // max(1, working)))
    return block_m, block_r, block_k, split_k


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Shrink ``x`` by each token's adapter A.

    Args:
        x: [T, K] float16/bfloat16/float32, last dim contiguous.
        lora_a: [S, R, K] in x's dtype, last dim contiguous.
        sorted_token_ids, counts, starts: ``reference.lora_segments`` of the step's slots.
        out: optional float32 [T, R] destination (last dim contiguous).
    Returns:
        float32 [T, R]; rows of tokens without an adapter are zero.
    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    check(x.dim() == 2 and lora_a.dim() == 3, f"x must be [T, K] and lora_a [S, R, K], got {tuple(x.shape)} "
                                              f"and {tuple(lora_a.shape)}")
    T, K = x.shape
    S, R, K2 = lora_a.shape
    check(K2 == K, f"lora_a has {K2} input features, x has {K}")
    check(x.dtype == lora_a.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"x and lora_a must share a float dtype, got {x.dtype} and {lora_a.dtype}")
    check(counts.numel() == S and starts.numel() == S and sorted_token_ids.numel() >= T,
          f"segments for {counts.numel()} slots and {sorted_token_ids.numel()} tokens, expected {S} and {T}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("lora_a", lora_a)
    if out is None:
        out = torch.empty(T, R, dtype=torch.float32, device=x.device)
    check(out.shape == (T, R) and out.dtype == torch.float32, f"out must be float32 [{T}, {R}]")
    check_last_dim_contiguous("out", out)
    out.zero_()
    if T == 0 or S == 0:
        return out
    block_m, block_r, block_k, split_k = shrink_blocks(T, K, R, S)
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)  # no empty split
    grid = (triton.cdiv(T, block_m), triton.cdiv(R, block_r), S * split_k)
    _lora_shrink_kernel[grid](x, lora_a, out, sorted_token_ids, counts, starts, K, R, k_per_split,
                              x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0), SPLIT_K=split_k,
                              BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
                              num_warps=1 if interpreting() else 4)
    return out
