"""RMSNorm and fused residual-add + RMSNorm (Triton), as Hugging Face's ``LlamaRMSNorm``.

One program per row; the row lives in registers (hidden sizes up to 65536).  Statistics in
float32; the normalized row is cast to the input dtype before the weight multiply, like
``weight * x_normed.to(input_dtype)``.  References: ``reference.rms_norm_ref`` and
``reference.fused_add_rms_norm_ref``.  ``rms_norm_quant_fp8`` also writes the per-token FP8
quantization of the normalized row (the next FP8 linear's input) from registers.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import check, check_last_dim_contiguous, next_power_of_2, row_warps
from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.pdl import launch_kwargs, pdl_start

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_quant_fp8"]

_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr,
    stride_x, stride_r, stride_o, stride_ro, stride_q,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # round the sum to the input dtype, as torch's `x + residual` does
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # product in float32, one rounding to the output dtype (= torch's bf16/fp16 multiply)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if QUANT:  # per-token FP8 of the stored row, as fp8_quant.per_token_quant_fp8 computes it
        yf = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(yf), axis=0), 1e-12) / 448.0
        q = tl.minimum(tl.maximum(yf / scale, -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)


def _check_common(x: torch.Tensor, weight: torch.Tensor) -> None:
    check(x.dim() == 2, f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    check(weight.shape == (x.shape[1],), f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    check(weight.device == x.device, f"weight on {weight.device}, x on {x.device}")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {x.dtype}")
    check(x.shape[1] <= _MAX_HIDDEN, f"hidden size {x.shape[1]} > {_MAX_HIDDEN}")
    check_last_dim_contiguous("x", x)
    check(weight.stride(0) == 1, "weight must be contiguous")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: Optional[torch.Tensor] = None,
             options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """RMSNorm of each row: ``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``.

    Args:
        x: ``[T, H]`` float16/bfloat16/float32, last dim contiguous (rows may be strided).
        weight: ``[H]``, contiguous.
        eps: added to the mean square.
        out: optional ``[T, H]`` destination in x's dtype (may be ``x`` itself).
        options: the engine's kernel options (programmatic dependent launch).
    Returns:
        ``[T, H]`` in x's dtype.
    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    _check_common(x, weight)
    if out is None:
        out = torch.empty_like(x)
    check(out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1, "bad out tensor")
    T, H = x.shape
    if T == 0:
        return out
    _rms_norm_kernel[(T,)](
        x, x, weight, out, out, out, out,
        x.stride(0), 0, out.stride(0), 0, 0,
        H, float(eps),
        HAS_RESIDUAL=False, BLOCK=next_power_of_2(H), num_warps=row_warps(H, x.device), **launch_kwargs(x.device, options),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, inplace: bool = False,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``; ``normed = rms_norm(new_residual)``, in one pass.

    Args:
        x, residual: ``[T, H]``, same dtype, last dim contiguous.
        weight: ``[H]``.
        eps: added to the mean square.
        inplace: if True, ``normed`` is written into ``x`` and ``new_residual`` into
            ``residual`` (vLLM's convention) and those two tensors are returned; otherwise
            both results are new tensors and the inputs are untouched.
        options: the engine's kernel options (programmatic dependent launch).
    Returns:
        ``(normed, new_residual)``, both ``[T, H]`` in x's dtype.
    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    _check_common(x, weight)
    check(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype")
    check(residual.device == x.device, "residual on another device")
    check_last_dim_contiguous("residual", residual)
    if inplace:
        out, res_out = x, residual
    else:
        out, res_out = torch.empty_like(x), torch.empty_like(residual)
    T, H = x.shape
    if T == 0:
        return out, res_out
    _rms_norm_kernel[(T,)](
        x, residual, weight, out, res_out, out, out,
        x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), 0,
        H, float(eps),
        HAS_RESIDUAL=True, BLOCK=next_power_of_2(H), num_warps=row_warps(H, x.device), **launch_kwargs(x.device, options),
    )
    return out, res_out


def rms_norm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """RMSNorm (after the residual add when ``residual`` is given) and the per-token FP8
    quantization of its output in one pass: the next FP8 linear's input without a second
    kernel reading the row back.

    Args:
        x, residual: ``[T, H]`` float16/bfloat16, last dim contiguous; the inputs are untouched.
        weight: ``[H]``.
        eps: added to the mean square.
        options: the engine's kernel options (programmatic dependent launch).
    Returns:
        ``(normed [T, H] in x's dtype, new_residual [T, H] or None, q float8_e4m3fn [T, H],
        scales float32 [T, 1])``; ``q`` and the scales are bit-identical to
        ``fp8_quant.per_token_quant_fp8(normed)``.
    Raises:
        ValueError: bad shapes, dtypes (float32 is refused), devices or strides.
    """
    _check_common(x, weight)
    check(x.dtype in (torch.float16, torch.bfloat16), f"FP8 quantization takes float16/bfloat16 rows, got {x.dtype}")
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype")
        check(residual.device == x.device, "residual on another device")
        check_last_dim_contiguous("residual", residual)
    T, H = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    q = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    if T == 0:
        return out, res_out, q, s
    _rms_norm_kernel[(T,)](
        x, x if residual is None else residual, weight, out, out if res_out is None else res_out, q, s,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        0 if res_out is None else res_out.stride(0), q.stride(0),
        H, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(H), QUANT=True, num_warps=row_warps(H, x.device),
        **launch_kwargs(x.device, options),
    )
    return out, res_out, q, s
