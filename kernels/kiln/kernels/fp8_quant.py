"""Dynamic per-token FP8 (E4M3) quantization of activations in one pass (for W8A8 FP8 GEMMs).

``per_token_quant_fp8(x)`` returns ``(q, scale)`` with ``scale[t] = max(|x[t, :]|, 1e-12) / 448``
(float32 ``[T, 1]``) and ``q = clamp(x / scale, -448, 448)`` in float8_e4m3fn: one read of x
and one write of q, where the torch reference (``reference.per_token_quant_fp8_ref``) makes several
passes (abs, amax, divide, clamp, cast).  One program per row; rows up to 32768 wide.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import per_token_quant_fp8_ref

__all__ = ["per_token_quant_fp8", "per_token_quant_fp8_ref"]


@triton.jit
def _per_token_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, K] (CUDA, last dim contiguous) -> (float8_e4m3fn [T, K], float32 scales [T, 1]).

    Raises:
        ValueError: not 2-D, last dim not contiguous, or K > 32768.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be 2-D with a contiguous last dimension")
    T, K = x.shape
    if K > 32768:
        raise ValueError(f"rows up to 32768 wide, got {K}")
    q = torch.empty((T, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    if T:
        block = triton.next_power_of_2(K)
        _per_token_quant_fp8_kernel[(T,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=block,
                                          num_warps=min(16, max(4, block // 1024)))
    return q, s
