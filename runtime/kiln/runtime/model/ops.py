"""Elementwise ops of the model with one dispatch point: Triton kernels from
``kiln.kernels`` on CUDA, plain torch on CPU (the CPU path is also what tests compare
the kernels with).  Shapes: ``x`` is ``[num_tokens, hidden]``."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def _kernels():
    """The ``kiln.kernels`` module when it provides the fused ops, else None."""
    try:
        import kiln.kernels as k  # noqa: PLC0415
    except Exception:  # pragma: no cover - kernels missing or triton broken
        return None
    needed = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
    return k if all(hasattr(k, n) for n in needed) else None


@functools.lru_cache(maxsize=1)
def _gemv():
    """The ``kiln.kernels.gemv`` module (small-M GEMV), or None when it cannot be imported."""
    try:
        import kiln.kernels.gemv as g  # noqa: PLC0415
    except Exception:  # pragma: no cover - kernels missing or triton broken
        return None
    return g


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` [T, K] @ ``weight`` [N, K]^T (+ ``bias``), in ``out_dtype`` (default ``x.dtype``).

    On CUDA, without bias, for T <= 8 and the (N, K, T) where the H200 sweep found
    ``kiln.kernels.gemv`` faster than cuBLAS (its ``TUNED`` table; batch-1 decode), the Triton
    GEMV; otherwise ``F.linear`` (the CPU path is always ``F.linear``)."""
    if (x.is_cuda and bias is None and x.dim() == 2 and x.shape[0] <= 8 and x.dtype == weight.dtype
            and weight.stride(1) == 1 and _gemv() is not None
            and _gemv().use_gemv(x.shape[0], weight.shape[0], weight.shape[1])):
        return _gemv().gemv(x, weight, out_dtype)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` lives on CUDA and the Triton kernels are importable."""
    return t.is_cuda and _kernels() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) as in HF ``LlamaRMSNorm``: float32 statistics,
    result cast back to ``x.dtype`` then scaled by ``weight``.  ``x``: [T, H]."""
    if use_triton(x):
        return _kernels().rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual``; returns ``(rms_norm(residual'), residual')``."""
    if use_triton(x):
        return _kernels().fused_add_rms_norm(x, residual, weight, eps)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer, 2020): ``x`` [T, 2I] -> ``silu(x[:, :I]) * x[:, I:]`` [T, I]."""
    if use_triton(x):
        return _kernels().silu_and_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al., RoFormer, 2021), rotate-half (NeoX/HF Llama) style.

    Args:
        positions: int64 [T] absolute positions.
        q: [T, Hq, D]; k: [T, Hkv, D].
        cos_sin_cache: float32 [max_position, D]: cos in the first D/2 columns, sin in the rest.
    Returns:
        (q, k) rotated, same shapes and dtypes.
    """
    if use_triton(q):
        return _kernels().rotary_embedding(positions, q, k, cos_sin_cache)
    cs = cos_sin_cache.index_select(0, positions)  # [T, D]
    half = cs.shape[-1] // 2
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:].unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)
