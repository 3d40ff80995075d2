"""Write new keys and values into the paged KV cache through the slot mapping (Triton).

Token ``t`` with ``slot = slot_mapping[t] >= 0`` goes to
``cache[slot // block_size, slot % block_size, :, :]`` (vLLM's ``reshape_and_cache``).
Offsets are int64 (pools larger than 2**31 elements are fine).  For a float8_e4m3fn cache
the stored value is ``clamp(x / scale, -448, 448)`` cast to fp8 (per-tensor or per-head
scale).  Reference: ``reference.reshape_and_cache_ref``.  Grid: one program per token.

``rotary_and_cache`` fuses the rotary embedding of q and k (``kiln.kernels.rotary``) with this
write: one launch per layer instead of two, the rotated keys go from registers to the cache
(vLLM and TensorRT-LLM fuse the same pair).  Reference: ``rotary_embedding_ref`` then
``reshape_and_cache_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import (
    Scale,
    check,
    check_last_dim_contiguous,
    interpreting,
    next_power_of_2,
    row_warps,
    scale_args,
)
from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.pdl import launch_kwargs, pdl_start
from kiln.kernels.rotary import _cos_sin, _rotate_heads

__all__ = ["reshape_and_cache", "rotary_and_cache"]

FP8_MAX = 448.0


@triton.jit
def _round_to_fp8_grid(x):
    """Round float32 ``x`` (|x| <= 448) to the nearest e4m3 value, ties to even, in float32.

    Only used under TRITON_INTERPRET=1: Triton 3.6's interpreter casts float32 to fp8 by
    truncation in the subnormal range and loses the carry when rounding crosses a power of
    two (1.98 -> 1.0).  After this rounding the cast is exact.  The GPU path casts directly.
    """
    b = x.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits, RNE
    ax = tl.abs(x)
    sub = ((ax * 512.0 + 12582912.0) - 12582912.0) / 512.0  # multiples of 2**-9, RNE
    sub = (sub.to(tl.int32, bitcast=True) | (b & -2147483648)).to(tl.float32, bitcast=True)  # keep the sign
    return tl.where(ax < 0.015625, sub, normal)


@triton.jit
def _to_cache(xf, scale_ptr, scale_stride, scale_val, h, num_heads, dtype: tl.constexpr,
              SCALE_MODE: tl.constexpr, FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    """float32 rows ``xf`` [BLOCK_H, W] of heads ``h`` as cache values: divided by the head's
    scale, clamped to +-448 and rounded to e4m3 for an fp8 cache, else cast to ``dtype``."""
    if FP8:
        if SCALE_MODE == 1:
            xf = xf / scale_val
        elif SCALE_MODE == 2:
            s = tl.load(scale_ptr + h * scale_stride, mask=h < num_heads, other=1.0)
            xf = xf / s[:, None]
        xf = tl.minimum(tl.maximum(xf, -448.0), 448.0)
        if ROUND_FP8:
            xf = _round_to_fp8_grid(xf)
    return xf.to(dtype)


@triton.jit
def _store_heads(
    x_ptr, stride_xh, cache_ptr, stride_ch, num_heads, head_dim,
    scale_ptr, scale_stride, scale_val,
    SCALE_MODE: tl.constexpr, FP8: tl.constexpr, ROUND_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_heads) & (d[None, :] < head_dim)
    x = tl.load(x_ptr + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    if FP8:
        y = _to_cache(x.to(tl.float32), scale_ptr, scale_stride, scale_val, h, num_heads, cache_ptr.dtype.element_ty,
                      SCALE_MODE, FP8, ROUND_FP8)
    else:
        y = x.to(cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + h[:, None] * stride_ch + d[None, :], y, mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale_ptr, k_scale_stride, k_scale_val, v_scale_ptr, v_scale_stride, v_scale_val,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    num_heads, head_dim, block_size,
    SCALE_MODE_K: tl.constexpr, SCALE_MODE_V: tl.constexpr, FP8: tl.constexpr, ROUND_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    _store_heads(
        key_ptr + t * stride_kt, stride_kh, k_cache_ptr + blk * stride_kcb + off * stride_kco, stride_kch,
        num_heads, head_dim, k_scale_ptr, k_scale_stride, k_scale_val, SCALE_MODE_K, FP8, ROUND_FP8, BLOCK_H, BLOCK_D,
    )
    _store_heads(
        value_ptr + t * stride_vt, stride_vh, v_cache_ptr + blk * stride_vcb + off * stride_vco, stride_vch,
        num_heads, head_dim, v_scale_ptr, v_scale_stride, v_scale_val, SCALE_MODE_V, FP8, ROUND_FP8, BLOCK_H, BLOCK_D,
    )


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T]
    k_scale: Scale = None,
    v_scale: Scale = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> None:
    """Scatter ``key``/``value`` rows into the caches at ``slot_mapping`` (in place).

    Args:
        key, value: ``[T, Hkv, D]`` float16/bfloat16/float32, last dim contiguous (token
            and head strides free).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` in the model dtype or
            float8_e4m3fn; last dim contiguous, other strides free (views allowed).
        slot_mapping: int64 (or int32) ``[T]``; ``-1`` skips the token.  Slots must be
            ``< num_blocks * block_size`` (not checked: a host sync).
        k_scale, v_scale: fp8 scales (float, 1-element or ``[Hkv]`` float32 tensor);
            ignored for non-fp8 caches.
        options: the engine's kernel options (programmatic dependent launch).
    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    check(key.dim() == 3 and key.shape == value.shape, f"key/value must be [T, Hkv, D], got {tuple(key.shape)}, {tuple(value.shape)}")
    T, H, D = key.shape
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache/v_cache must be [num_blocks, block_size, Hkv, D] and equal")
    check(k_cache.shape[2] == H and k_cache.shape[3] == D, f"cache {tuple(k_cache.shape)} does not match key {tuple(key.shape)}")
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    check(slot_mapping.shape == (T,) and slot_mapping.dtype in (torch.int64, torch.int32), "slot_mapping must be int [T]")
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        check(t.device == key.device, f"{name} on {t.device}, key on {key.device}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if T == 0:
        return
    ks = scale_args(k_scale if fp8 else None, H, key, "k_scale")
    vs = scale_args(v_scale if fp8 else None, H, key, "v_scale")
    _reshape_and_cache_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H, D, k_cache.shape[1],
        SCALE_MODE_K=ks[3], SCALE_MODE_V=vs[3], FP8=fp8, ROUND_FP8=fp8 and interpreting(),
        BLOCK_H=next_power_of_2(H), BLOCK_D=next_power_of_2(D), num_warps=row_warps(H * D, key.device),
        **launch_kwargs(key.device, options),
    )


@triton.jit
def _rotary_cache_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale_ptr, k_scale_stride, k_scale_val, v_scale_ptr, v_scale_stride, v_scale_val,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    num_q_heads, num_heads, half, block_size,
    SCALE_MODE_K: tl.constexpr, SCALE_MODE_V: tl.constexpr, FP8: tl.constexpr, ROUND_FP8: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, t, stride_cs, half, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, half, cos, sin, BLOCK_HQ, BLOCK_HALF)
    # keys: rotated in place (the caller's k), and the rotated halves from registers into the cache
    y1, y2, h, mask = _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_heads, half, cos, sin, BLOCK_H, BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        d = tl.arange(0, BLOCK_HALF)
        c1 = k_cache_ptr + blk * stride_kcb + off * stride_kco + h[:, None] * stride_kch + d[None, :]
        dt = k_cache_ptr.dtype.element_ty
        tl.store(c1, _to_cache(y1.to(tl.float32), k_scale_ptr, k_scale_stride, k_scale_val, h, num_heads, dt,
                               SCALE_MODE_K, FP8, ROUND_FP8), mask=mask)
        tl.store(c1 + half, _to_cache(y2.to(tl.float32), k_scale_ptr, k_scale_stride, k_scale_val, h, num_heads, dt,
                                      SCALE_MODE_K, FP8, ROUND_FP8), mask=mask)
        _store_heads(
            v_ptr + t * stride_vt, stride_vh, v_cache_ptr + blk * stride_vcb + off * stride_vco, stride_vch,
            num_heads, 2 * half, v_scale_ptr, v_scale_stride, v_scale_val, SCALE_MODE_V, FP8, ROUND_FP8, BLOCK_H,
            2 * BLOCK_HALF,
        )


def rotary_and_cache(
    positions: torch.Tensor,  # int64 [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_position, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T]
    k_scale: Scale = None,
    v_scale: Scale = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding(positions, q, k, cos_sin_cache)`` then ``reshape_and_cache(k, v,
    k_cache, v_cache, slot_mapping, k_scale, v_scale)`` in one launch; returns ``(q, k)``
    (rotated in place).  The cached keys are the rotated keys in ``k``'s dtype, converted to
    the cache dtype exactly as ``reshape_and_cache`` converts them.

    Args: as the two functions (``q``, ``k``, ``v``: float16/bfloat16/float32 ``[T, H, D]``
        with the last dim contiguous, e.g. views of a fused QKV output; ``D`` even; caches in
        the model dtype or float8_e4m3fn; ``-1`` slots are not written, their q and k are
        still rotated).  As for the two kernels, positions must be in ``[0, max_position)`` and
        slots below ``num_blocks * block_size``: not checked (that would need a host sync; the
        model runner derives both from the block tables), an index out of range reads or
        writes outside the tensors.
    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    check(q.dim() == 3 and k.dim() == 3 and v.shape == k.shape,
          f"q, k, v must be [T, H, D] with k, v equal, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, Hq, D = q.shape
    H = k.shape[1]
    check(k.shape[0] == T and k.shape[2] == D, f"k shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(D % 2 == 0, f"head_dim must be even, got {D}")
    check(positions.shape == (T,) and positions.dtype in (torch.int64, torch.int32), "positions must be int [T]")
    check(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == D, f"cos_sin_cache must be [max_pos, {D}]")
    check(q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"q, k, v must share a float16/bfloat16/float32 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
          "k_cache/v_cache must be [num_blocks, block_size, Hkv, D], equal shapes and dtypes")
    check(k_cache.shape[2] == H and k_cache.shape[3] == D, f"cache {tuple(k_cache.shape)} does not match k {tuple(k.shape)}")
    check(slot_mapping.shape == (T,) and slot_mapping.dtype in (torch.int64, torch.int32), "slot_mapping must be int [T]")
    for name, t in (("positions", positions), ("k", k), ("v", v), ("cos_sin_cache", cos_sin_cache),
                    ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        check(t.device == q.device, f"{name} on {t.device}, q on {q.device}")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos_sin_cache", cos_sin_cache), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if T == 0:
        return q, k
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    ks = scale_args(k_scale if fp8 else None, H, k, "k_scale")
    vs = scale_args(v_scale if fp8 else None, H, k, "v_scale")
    half = D // 2
    _rotary_cache_kernel[(T,)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Hq, H, half, k_cache.shape[1],
        SCALE_MODE_K=ks[3], SCALE_MODE_V=vs[3], FP8=fp8, ROUND_FP8=fp8 and interpreting(),
        BLOCK_HQ=next_power_of_2(Hq), BLOCK_H=next_power_of_2(H), BLOCK_HALF=next_power_of_2(half),
        num_warps=row_warps(Hq * half, q.device), **launch_kwargs(q.device, options),
    )
    return q, k
