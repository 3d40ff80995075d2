"""Rotary position embedding (rotate-half / NeoX style, as HF Llama) in Triton, in place.

One program per token rotates every query and key head of that token:
``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin`` (halves of the head), with
``cos | sin = cos_sin_cache[position]`` from ``reference.build_cos_sin_cache`` (which also
covers Llama-3 and linear scaling).  Arithmetic in float32.  Reference:
``reference.rotary_embedding_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import check, check_last_dim_contiguous, next_power_of_2, row_warps
from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.pdl import launch_kwargs, pdl_start

__all__ = ["rotary_embedding"]


@triton.jit
def _cos_sin(pos_ptr, cs_ptr, t, stride_cs, half, BLOCK_D: tl.constexpr):
    """float32 ``cos``, ``sin`` [BLOCK_D] of token ``t``'s position (the halves of its
    ``cos_sin_cache`` row; lanes past ``half`` read 0)."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + half + d, mask=dmask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, half, cos, sin, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate one token's heads in place; returns the rotated halves ``y1``, ``y2`` [BLOCK_H,
    BLOCK_D] (x's dtype), the head indices [BLOCK_H] and the [BLOCK_H, BLOCK_D] mask."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_heads) & (d[None, :] < half)
    p1 = x_ptr + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    y1 = (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype)
    y2 = (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype)
    tl.store(p1, y1, mask=mask)
    tl.store(p1 + half, y2, mask=mask)
    return y1, y2, h, mask


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, t, stride_cs, half, BLOCK_D)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, half, cos, sin, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, half, cos, sin, BLOCK_HK, BLOCK_D)


def rotary_embedding(
    positions: torch.Tensor,  # int64 [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_position, D]
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place by their token's position; returns ``(q, k)``.

    Args:
        positions: int64 (or int32) ``[T]``, each in ``[0, max_position)`` (not checked:
            that would need a host sync).
        q: ``[T, Hq, D]`` float16/bfloat16/float32, last dim contiguous (token and head
            strides free, e.g. a view of a fused QKV output).
        k: ``[T, Hkv, D]``, same dtype and rules.
        cos_sin_cache: ``[max_position, D]`` (cos half then sin half), any float dtype,
            last dim contiguous.
        options: the engine's kernel options (programmatic dependent launch).
    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    check(q.dim() == 3 and k.dim() == 3, f"q, k must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    T, Hq, D = q.shape
    check(k.shape[0] == T and k.shape[2] == D, f"k shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(D % 2 == 0, f"head_dim must be even, got {D}")
    check(positions.shape == (T,) and positions.dtype in (torch.int64, torch.int32), "positions must be int [T]")
    check(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == D, f"cos_sin_cache must be [max_pos, {D}]")
    check(q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32), "bad q/k dtype")
    for name, t in (("positions", positions), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check(t.device == q.device, f"{name} on {t.device}, q on {q.device}")
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    if T == 0:
        return q, k
    half = D // 2
    _rotary_kernel[(T,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        Hq, k.shape[1], half,
        BLOCK_HQ=next_power_of_2(Hq), BLOCK_HK=next_power_of_2(k.shape[1]), BLOCK_D=next_power_of_2(half),
        num_warps=row_warps(Hq * half, q.device), **launch_kwargs(q.device, options),
    )
    return q, k
