"""Torch reference implementations of every Kiln kernel (the CPU path and the test oracle).

Plain torch, no Triton import (importable where Triton is not installed): the runtime's CPU
path calls these functions, so each op has exactly one torch version.  Each function has the same
signature and semantics as its Triton twin in ``kiln.kernels`` (name without ``_ref``).
They run on any device and in any floating dtype; pass float64 inputs (or caches) to get
a float64 oracle.  Internal arithmetic is done in float32, or float64 when the inputs are
float64, and results are cast back to the input dtype.

KV cache layout (one layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
        dtype = model dtype, or torch.float8_e4m3fn with a scale (x_real = x_fp8 * scale)
    slot = block_id * block_size + offset_in_block
    slot_mapping: int64 [num_tokens], -1 = padding token (skipped)
    block_tables: int32 [num_seqs, max_blocks_per_seq]; entries past a sequence's
        context are never read

A scale is a Python float, a 1-element tensor (per tensor) or a float tensor
``[num_kv_heads]`` (per head).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from kiln.kernels import int4_format

__all__ = [
    "FP8_E4M3_MAX",
    "reshape_and_cache_ref",
    "paged_attention_ref",
    "rms_norm_ref",
    "fused_add_rms_norm_ref",
    "inv_freq",
    "build_cos_sin_cache",
    "rotary_embedding_ref",
    "silu_and_mul_ref",
    "gemv_ref",
    "dequantize_ref",
    "w4a16_ref",
    "per_token_quant_fp8_ref",
]

Scale = Union[float, torch.Tensor, None]

#: Largest finite value of torch.float8_e4m3fn; values are clamped to +-this before the cast.
FP8_E4M3_MAX = 448.0


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _scale_tensor(scale: Scale, num_kv_heads: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A scale as a ``[num_kv_heads, 1]`` tensor (broadcast over ``head_dim``).

    Raises:
        ValueError: if a tensor scale has neither 1 nor ``num_kv_heads`` elements.
    """
    if scale is None:
        return torch.ones(num_kv_heads, 1, dtype=dtype, device=device)
    if isinstance(scale, torch.Tensor):
        s = scale.detach().to(device=device, dtype=dtype).reshape(-1)
        if s.numel() == 1:
            s = s.expand(num_kv_heads)
        elif s.numel() != num_kv_heads:
            raise ValueError(f"scale has {s.numel()} elements, expected 1 or num_kv_heads={num_kv_heads}")
        return s.reshape(num_kv_heads, 1)
    return torch.full((num_kv_heads, 1), float(scale), dtype=dtype, device=device)


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T]
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    """Write new keys/values into the paged cache at ``slot_mapping`` (in place).

    Token ``t`` goes to ``cache[slot // block_size, slot % block_size]`` with
    ``slot = slot_mapping[t]``; tokens with slot ``-1`` are skipped.  For a float8_e4m3fn
    cache the stored value is ``clamp(x / scale, +-448)`` cast to fp8; for other cache
    dtypes the scales are ignored and ``x`` is cast to the cache dtype.
    """
    T, Hkv, D = key.shape
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blk = slots // block_size
    off = slots % block_size
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        xv = x[valid]
        if _is_fp8(cache):
            cd = _compute_dtype(x)
            s = _scale_tensor(scale, Hkv, cd, x.device)
            xv = (xv.to(cd) / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        cache[blk, off] = xv.to(cache.dtype)


def _gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: Scale, dtype: torch.dtype
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence as ``[seq_len, Hkv, D]`` in ``dtype``."""
    block_size, Hkv = cache.shape[1], cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    kv = cache[ids].reshape(num_blocks * block_size, Hkv, cache.shape[3])[:seq_len].to(dtype)
    if _is_fp8(cache):
        kv = kv * _scale_tensor(scale, Hkv, dtype, cache.device)
    return kv


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # int32 [S, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [S]
    cu_seqlens_q: torch.Tensor,  # int32 [S + 1]
    scale: float,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:  # [T, Hq, D], dtype of q
    """Causal attention of new query tokens over the paged KV cache (prefill, decode, mixed).

    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` (``q_len`` rows).
    ``seq_lens[s]`` is its whole context length including the new tokens, whose K/V are
    already in the cache.  Query row ``j`` sits at position ``seq_lens[s] - q_len + j`` and
    attends to key positions ``0..`` that position.  GQA: query head ``h`` reads KV head
    ``h // (Hq // Hkv)``.  Softmax is ``softmax(scale * q.k)``.  Rows of ``q`` not owned by
    any sequence (after ``cu_seqlens_q[-1]``) are returned as zeros here (the Triton kernel
    leaves them unwritten).  A sequence with ``seq_len == 0`` (a padded decode slot) gets
    zeros.

    Decode rows (one query token) are attended in one batch: their K/V are gathered into a
    padded ``[S, Hkv, L, D]`` tensor and the query heads of a KV head stacked on the query
    axis, under a length mask; longer query runs go one sequence at a time with a causal mask
    offset by the cached prefix.  Both through ``scaled_dot_product_attention`` in the
    compute dtype (float32, or float64 for float64 inputs).

    Raises:
        ValueError: on inconsistent shapes (Hq not a multiple of Hkv, head_dim mismatch,
            q_len > seq_len).
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if Hq % Hkv != 0 or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    group = Hq // Hkv
    cd = _compute_dtype(q, k_cache, v_cache)
    out = torch.zeros(T, Hq, D, dtype=cd, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[s + 1] - cu[s] for s in range(len(lens))]
    for s, ctx in enumerate(lens):
        if ctx > 0 and q_lens[s] > ctx:
            raise ValueError(f"sequence {s}: q_len {q_lens[s]} > seq_len {ctx}")
    dec = [s for s, ctx in enumerate(lens) if q_lens[s] == 1 and ctx > 0]
    if dec:
        _decode_rows(out, q, k_cache, v_cache, block_tables, [lens[s] for s in dec], [cu[s] for s in dec], dec,
                     scale, k_scale, v_scale, cd)
    for s, ctx in enumerate(lens):
        n = q_lens[s]
        if n <= 1 or ctx == 0:
            continue
        k = _gather_kv(k_cache, block_tables[s], ctx, k_scale, cd).transpose(0, 1)  # [Hkv, ctx, D]
        v = _gather_kv(v_cache, block_tables[s], ctx, v_scale, cd).transpose(0, 1)
        qs = q[cu[s]:cu[s] + n].to(cd)  # [n, Hq, D]
        qg = qs.view(n, Hkv, group, D).permute(1, 2, 0, 3).reshape(Hkv, group * n, D)  # heads of a KV head stacked
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = (torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos.unsqueeze(1)).repeat(group, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [Hkv, group * n, D]
        out[cu[s]:cu[s] + n] = o.view(Hkv, group, n, D).permute(2, 0, 1, 3).reshape(n, Hq, D)
    return out.to(q.dtype)


def _decode_rows(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lens: list[int], rows: list[int], seqs: list[int], scale: float,
                 k_scale: Scale, v_scale: Scale, cd: torch.dtype) -> None:
    """``paged_attention_ref`` of one-query-row sequences ``seqs`` (contexts ``lens`` > 0,
    query rows ``rows``) in one padded batch, written into ``out`` [T, Hq, D] (``cd``)."""
    Hq, D = q.shape[1], q.shape[2]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    n, L = len(seqs), max(lens)
    nblk = (L + bs - 1) // bs
    idx = torch.tensor(seqs, device=q.device)
    tables = block_tables.index_select(0, idx)[:, :nblk].to(torch.int64)  # [n, nblk]
    own = torch.tensor([(L_s + bs - 1) // bs for L_s in lens], device=q.device)
    # entries past a sequence's own blocks are never read (masked below): point them at block 0
    tables = torch.where(torch.arange(nblk, device=q.device).unsqueeze(0) < own.unsqueeze(1), tables, 0).reshape(-1)
    kv = []
    for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)):
        x = cache.index_select(0, tables).view(n, nblk * bs, Hkv, D)[:, :L].to(cd)
        if _is_fp8(cache):
            x = x * _scale_tensor(sc, Hkv, cd, cache.device)
        kv.append(x.transpose(1, 2))  # [n, Hkv, L, D]
    lens_t = torch.tensor(lens, device=q.device)
    mask = (torch.arange(L, device=q.device).unsqueeze(0) < lens_t.unsqueeze(1)).view(n, 1, 1, L)
    rows_t = torch.tensor(rows, device=q.device)
    qd = q.index_select(0, rows_t).to(cd).view(n, Hkv, Hq // Hkv, D)
    o = F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=mask, scale=scale)  # [n, Hkv, group, D]
    out.index_copy_(0, rows_t, o.reshape(n, Hq, D))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as Hugging Face's ``LlamaRMSNorm``.

    ``weight * (x / sqrt(mean(x**2) + eps)).to(x.dtype)``, with the statistics in float32
    (float64 for float64 input).  x: ``[T, H]`` (any leading dims), weight ``[H]``.
    """
    cd = _compute_dtype(x)
    xf = x.to(cd)
    var = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (in x's dtype), then ``rms_norm_ref(new_residual)``.

    Returns ``(normed, new_residual)``; the inputs are not modified.
    """
    new_residual = (x + residual).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def inv_freq(head_dim: int, base: float, rope_scaling: Optional[dict]) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` (float32), as transformers computes them.

    ``rope_scaling`` "linear" divides the frequencies by ``factor``; "llama3" applies Llama
    3.1's wavelength-dependent scaling (Meta, 2024; transformers'
    ``_compute_llama3_parameters``): long wavelengths are divided by ``factor``, short ones
    kept, and the band in between interpolated smoothly (``low_freq_factor`` 1,
    ``high_freq_factor`` 4 and ``original_max_position_embeddings`` 8192 when absent).

    Raises:
        ValueError: an unsupported scaling type.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling.get("factor", 1.0))
    if rope_type == "llama3":
        # transformers.modeling_rope_utils._compute_llama3_parameters, step for step.
        factor = float(rope_scaling.get("factor", 1.0))
        low_freq_factor = float(rope_scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(rope_scaling.get("high_freq_factor", 4.0))
        old_context_len = float(rope_scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Optional[dict] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [max_position, head_dim]
    """The rotary table: row ``p`` = ``[cos(p * inv_freq), sin(p * inv_freq)]``.

    Each half has ``head_dim // 2`` columns.  ``rope_scaling`` is None or a dict with
    ``rope_type`` (or legacy ``type``) ``"default"``, ``"linear"`` (``factor``) or
    ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``), matching transformers 5.x.  The angles are
    computed in float32 like transformers' ``LlamaRotaryEmbedding``, then cast to ``dtype``.

    Raises:
        ValueError: for an odd ``head_dim`` or an unsupported scaling type.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq(head_dim, base, rope_scaling))  # [max_position, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX / HF ``rotate_half`` rotation; x ``[T, H, D]``, cos/sin ``[T, 1, D // 2]``."""
    cd = _compute_dtype(x, cos)
    half = x.shape[-1] // 2
    x1 = x[..., :half].to(cd)
    x2 = x[..., half:].to(cd)
    cos, sin = cos.to(cd), sin.to(cd)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,  # int64 [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_position, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (rotate-half / NeoX style, as HF Llama) on q and k.

    ``out[..., :D/2] = x1 cos - x2 sin``, ``out[..., D/2:] = x2 cos + x1 sin`` with
    ``x1, x2`` the halves of the head and ``cos, sin = cos_sin_cache[positions]`` split in
    halves; computed in float32 (float64 if inputs are) and cast back.  Returns new
    tensors ``(q_out, k_out)``.
    """
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]  # [T, D]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: ``silu(x[..., :I]) * x[..., I:]`` for x ``[T, 2I]``; returns ``[T, I]``.

    Computed in float32 (float64 for float64 input), cast back to x's dtype.
    """
    cd = _compute_dtype(x)
    inter = x.shape[-1] // 2
    gate = x[..., :inter].to(cd)
    up = x[..., inter:].to(cd)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x`` [M, K] @ ``weight`` [N, K]^T in float32 -> [M, N] in ``out_dtype`` (default ``x.dtype``)."""
    return (x.float() @ weight.float().t()).to(out_dtype or x.dtype)


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    """float32 ``W`` [N, K] from the packed int4 format (``kiln.kernels.int4_format``)."""
    return int4_format.dequantize(qweight, scales, qzeros, torch.float32)


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] @ dequant(W)^T -> [M, N] in ``x.dtype`` (float32 math)."""
    return (x.float() @ dequantize_ref(qweight, scales, qzeros).t()).to(x.dtype)


def per_token_quant_fp8_ref(x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row FP8: ``x`` float [T, K] -> (float8_e4m3fn [T, K], float32 scales [T, 1])
    with ``scale[t] = max(amax[t], 1e-12) / 448`` and ``x ≈ q * scale``; ``amax`` float32 [T, 1]
    defaults to ``max|x[t, :]|`` (pass it when ``x`` is one shard of a wider row: the row's max)."""
    if amax is None:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = amax.float().clamp(min=1e-12) / FP8_E4M3_MAX
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale
