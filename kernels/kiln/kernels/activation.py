"""SiLU-and-mul (the SwiGLU gate of Llama's MLP) in Triton.

``out = silu(x[:, :I]) * x[:, I:]`` for ``x = [gate | up]``, computed in float32 and cast
to x's dtype.  Reference: ``reference.silu_and_mul_ref``.  Grid: (tokens, ceil(I / BLOCK)).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import tuning
from kiln.kernels.launch import check, check_last_dim_contiguous, interpreting
from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.pdl import launch_kwargs, pdl_start

__all__ = ["silu_and_mul"]


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None,
                 options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]``.

    Args:
        x: ``[T, 2I]`` float16/bfloat16/float32, last dim contiguous.
        out: optional ``[T, I]`` destination in x's dtype, last dim contiguous.
        options: the engine's kernel options (programmatic dependent launch).
    Returns:
        ``[T, I]`` in x's dtype.
    Raises:
        ValueError: odd last dim, bad dtype, strides or ``out``.
    """
    check(x.dim() == 2, f"x must be [num_tokens, 2 * intermediate], got {tuple(x.shape)}")
    check(x.shape[1] % 2 == 0, f"last dim must be even, got {x.shape[1]}")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {x.dtype}")
    check_last_dim_contiguous("x", x)
    T, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    check(out.shape == (T, inter) and out.dtype == x.dtype and out.device == x.device, "bad out tensor")
    check_last_dim_contiguous("out", out)
    if T == 0 or inter == 0:
        return out
    elementwise = tuning.table(x.device).elementwise
    block = 128 if interpreting() else elementwise["BLOCK"]
    block = min(block, triton.next_power_of_2(inter))
    grid = (T, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter,
        BLOCK=block, num_warps=1 if interpreting() else elementwise["num_warps"],
        **launch_kwargs(x.device, options),
    )
    return out
