"""LoRA shrink over token segments in Triton: ``h[t] = x[t] @ A[slot(t)].T`` (float32).

Grid: (token blocks of a segment, rank blocks, slots).  Each program reads its slot's token
count and returns at once past it, so the grid depends only on ``T`` and ``S`` (fixed for a
CUDA graph) while the work follows the step's adapters.  Reference: ``reference.
lora_shrink_ref`` (rows without an adapter are zero there; here they are left untouched and
``lora_shrink`` zeroes the output first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import check, check_last_dim_contiguous, interpreting

__all__ = ["lora_shrink"]


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ptr, counts_ptr, starts_ptr, K, R,
                        stride_xm, stride_as, stride_ar, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    slot = tl.program_id(2)
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
    for k0 in range(0, K, BLOCK_K):
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
    tl.store(out_ptr + tok[:, None] * stride_om + offs_r[None, :], acc, mask=mask_m[:, None] & mask_r[None, :])


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
    block_m = 16 if interpreting() or T <= 16 else 32 if T <= 64 else 64
    block_r = max(16, triton.next_power_of_2(R))
    block_k = 32 if interpreting() else 64
    grid = (triton.cdiv(T, block_m), triton.cdiv(R, block_r), S)
    _lora_shrink_kernel[grid](x, lora_a, out, sorted_token_ids, counts, starts, K, R,
                              x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
                              BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
                              num_warps=1 if interpreting() else 4)
    return out
