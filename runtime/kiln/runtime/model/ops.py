"""The model's elementwise ops and small-M linear, with one dispatch point: the Triton kernels
of ``kiln.kernels`` for CUDA tensors (launched with the engine's ``KernelOptions``), the torch
references of ``kiln.kernels.reference`` otherwise (the CPU path: one torch version per op,
shared with the kernel tests).  Shapes: ``x`` is ``[num_tokens, hidden]``."""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
import torch.nn.functional as F

from kiln.kernels import reference
from kiln.kernels.options import KernelOptions


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _kernel_module(name: str):
    """``kiln.kernels.<name>`` (imports Triton; called for CUDA tensors only)."""
    return importlib.import_module(f"kiln.kernels.{name}")


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` lives on CUDA and Triton is installed (the kernels apply)."""
    return t.is_cuda and _triton_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, options: KernelOptions,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` [T, K] @ ``weight`` [N, K]^T (+ ``bias``), in ``out_dtype`` (default ``x.dtype``).

    On CUDA, without bias, for T <= 8 and the (N, K, T) where the device's tuning table lists
    ``kiln.kernels.gemv`` as faster than cuBLAS (batch-1 decode), the Triton GEMV; otherwise
    ``F.linear`` (the CPU path is always ``F.linear``)."""
    if (use_triton(x) and bias is None and x.dim() == 2 and x.shape[0] <= 8 and x.dtype == weight.dtype
            and weight.stride(1) == 1):
        gemv = _kernel_module("gemv")
        if gemv.use_gemv(x.shape[0], weight.shape[0], weight.shape[1], x.device):
            return gemv.gemv(x, weight, out_dtype, options=options)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, options: KernelOptions) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) as in HF ``LlamaRMSNorm``: float32 statistics,
    result cast back to ``x.dtype`` then scaled by ``weight``.  ``x``: [T, H]."""
    if use_triton(x):
        return _kernel_module("norm").rms_norm(x, weight, eps, options=options)
    return reference.rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       options: KernelOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual``; returns ``(rms_norm(residual'), residual')``, both [T, H]."""
    if use_triton(x):
        return _kernel_module("norm").fused_add_rms_norm(x, residual, weight, eps, options=options)
    return reference.fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                      options: KernelOptions):
    """RMSNorm (after the residual add when given) with the per-token FP8 quantization of its
    output in the same kernel: ``(normed, new_residual or None, q float8_e4m3fn [T, H], scales
    float32 [T, 1])``, or None off CUDA / for float32 (the caller then runs the plain norm)."""
    if not use_triton(x) or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    return _kernel_module("norm").rms_norm_quant_fp8(x, weight, eps, residual, options=options)


def silu_and_mul(x: torch.Tensor, options: KernelOptions) -> torch.Tensor:
    """SwiGLU activation (Shazeer, 2020): ``x`` [T, 2I] -> ``silu(x[:, :I]) * x[:, I:]`` [T, I]."""
    if use_triton(x):
        return _kernel_module("activation").silu_and_mul(x, options=options)
    return reference.silu_and_mul_ref(x)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     options: KernelOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al., RoFormer, 2021), rotate-half (NeoX/HF Llama) style.

    Args:
        positions: int64 [T] absolute positions.
        q: [T, Hq, D]; k: [T, Hkv, D].
        cos_sin_cache: float32 [max_position, D]: cos in the first D/2 columns, sin in the rest.
        options: the engine's kernel options (CUDA).
    Returns:
        (q, k) rotated, same shapes and dtypes (in place on CUDA, new tensors on the CPU).
    """
    if use_triton(q):
        return _kernel_module("rotary").rotary_embedding(positions, q, k, cos_sin_cache, options=options)
    return reference.rotary_embedding_ref(positions, q, k, cos_sin_cache)
