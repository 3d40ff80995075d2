"""LoRA expand over token segments in Triton, every part of a fused linear in one launch:
``y[t, off + c_p : off + c_p + N_p] += h[t, p*R:(p+1)*R] @ B[slot(t), c_p:c_p + N_p].T``.

A fused linear's output is the concatenation of its parts (q|k|v, gate|up), each with its
own adapter: ``B`` stacks the parts' ``[N_p, R]`` matrices along N (part ``p`` starts at row
``c_p``) and ``h`` holds their shrunk inputs side by side.  Grid: (token blocks of a segment,
column blocks of the widest part, slots x parts), as ``shrink``; a program past its part's
width or its slot's tokens returns at once.  Every token belongs to one segment and every
column to one part, so the programs' read-modify-writes of ``y`` never overlap.  ``h``
(float32) is cast to B's dtype for the dot (float32 accumulation).  Reference: ``reference.
lora_expand_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import check, check_last_dim_contiguous, interpreting

__all__ = ["lora_expand"]

#: Parts of one fused linear the kernel takes (q|k|v).
MAX_PARTS = 3


@triton.jit
def _lora_expand_kernel(h_ptr, b_ptr, y_ptr, sorted_ptr, counts_ptr, starts_ptr, R, END0, END1, END2,
                        stride_hm, stride_bs, stride_bn, stride_ym, y_offset, NUM_PARTS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2) // NUM_PARTS
    part = tl.program_id(2) % NUM_PARTS
    lo = tl.where(part == 0, 0, tl.where(part == 1, END0, END1))  # the part's first row of B / column of y
    hi = tl.where(part == 0, END0, tl.where(part == 1, END1, END2))
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    if lo + pid_n * BLOCK_N >= hi:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tok = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    ht = tl.load(h_ptr + tok[:, None] * stride_hm + part * R + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :],
                 other=0.0)
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                 mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
    if IEEE:
        delta = tl.dot(ht, bt, input_precision="ieee")
    else:
        delta = tl.dot(ht.to(bt.dtype), bt)
    y_ptrs = y_ptr + tok[:, None] * stride_ym + y_offset + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, sorted_token_ids: torch.Tensor,
                counts: torch.Tensor, starts: torch.Tensor, offset: int = 0,
                part_sizes: list[int] | None = None) -> torch.Tensor:
    """Add each token's adapter delta to the base output, in place.

    Args:
        y: [T, >= offset + N] float16/bfloat16/float32 (last dim contiguous).
        h: float32 [T, P*R] (a column slice of a wider shrink output is fine): part ``p``'s
            shrunk input in columns ``p*R:(p+1)*R``.
        lora_b: [S, N, R] in y's dtype, last dim contiguous, the scaling folded in; the parts'
            B stacked along N.
        sorted_token_ids, counts, starts: ``reference.lora_segments`` of the step's slots.
        offset: first column of ``y`` written.
        part_sizes: the parts' widths ``N_p`` (sum ``N``; at most ``MAX_PARTS``); None: one part.
    Returns:
        ``y``.
    Raises:
        ValueError: shapes, dtypes or strides that do not match.
    """
    check(y.dim() == 2 and h.dim() == 2 and lora_b.dim() == 3,
          f"y must be [T, N], h [T, R] and lora_b [S, N, R], got {tuple(y.shape)}, {tuple(h.shape)}, "
          f"{tuple(lora_b.shape)}")
    T = y.shape[0]
    S, N, R = lora_b.shape
    parts = [N] if part_sizes is None else [int(n) for n in part_sizes]
    check(1 <= len(parts) <= MAX_PARTS and sum(parts) == N and all(n > 0 for n in parts),
          f"part sizes {parts} must be 1..{MAX_PARTS} positive widths summing to lora_b's {N} rows")
    P = len(parts)
    check(h.shape == (T, P * R) and h.dtype == torch.float32,
          f"h must be float32 [{T}, {P * R}], got {h.dtype} {tuple(h.shape)}")
    check(0 <= offset and offset + N <= y.shape[1], f"columns {offset}:{offset + N} outside y's {y.shape[1]}")
    check(y.dtype == lora_b.dtype and y.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"y and lora_b must share a float dtype, got {y.dtype} and {lora_b.dtype}")
    check(counts.numel() == S and starts.numel() == S and sorted_token_ids.numel() >= T,
          f"segments for {counts.numel()} slots and {sorted_token_ids.numel()} tokens, expected {S} and {T}")
    check(R <= 128, f"rank {R} above the kernel's 128")
    for name, t in (("y", y), ("h", h), ("lora_b", lora_b)):
        check_last_dim_contiguous(name, t)
    if T == 0 or S == 0:
        return y
    ends = [sum(parts[:i + 1]) for i in range(P)] + [N] * (MAX_PARTS - P)
    block_m = 16 if interpreting() or T <= 16 else 32 if T <= 64 else 64
    block_n = 32 if interpreting() else 64
    block_r = max(16, triton.next_power_of_2(R))
    grid = (triton.cdiv(T, block_m), triton.cdiv(max(parts), block_n), S * P)
    _lora_expand_kernel[grid](h, lora_b, y, sorted_token_ids, counts, starts, R, *ends,
                              h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0), offset, NUM_PARTS=P,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=y.dtype == torch.float32,
                              num_warps=1 if interpreting() else 4)
    return y
