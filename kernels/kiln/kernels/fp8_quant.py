"""Dynamic per-token FP8 (E4M3) quantization of activations in one pass (for W8A8 FP8 GEMMs).

``per_token_quant_fp8(x)`` returns ``(q, scale)`` with ``scale[t] = max(|x[t, :]|, 1e-12) / 448``
(float32 ``[T, 1]``) and ``q = clamp(x / scale, -448, 448)`` in float8_e4m3fn: one read of x
and one write of q, where the torch reference (``reference.per_token_quant_fp8_ref``) makes several
passes (abs, amax, divide, clamp, cast).  One program per row; rows up to 32768 wide.

``per_token_quant_fp8(x, amax)`` takes the rows' ``max|x|`` instead of computing it: a
row-parallel layer at tensor-parallel size N holds 1/N of each row, and quantizes it with the
max of the whole row (its shards' maxima all-reduced) so every rank rounds as one rank would.

``silu_and_mul_quant_fp8(gate_up)`` is SwiGLU followed by the same quantization in one kernel
(the down projection's input): ``silu(g) * u`` is rounded to the input dtype, as
``silu_and_mul`` stores it, then quantized from registers, so the result is bit-identical to
``per_token_quant_fp8(silu_and_mul(gate_up))`` without the round trip of the activation
through memory or the second launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import per_token_quant_fp8_ref

__all__ = ["per_token_quant_fp8", "per_token_quant_fp8_ref", "silu_and_mul_quant_fp8", "silu_and_mul_quant_fp8_ref"]


def silu_and_mul_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_quant_fp8_ref(silu_and_mul_ref(x))``: ``x`` [T, 2I] -> (float8_e4m3fn [T, I],
    float32 scales [T, 1])."""
    from kiln.kernels.reference import silu_and_mul_ref  # noqa: PLC0415

    return per_token_quant_fp8_ref(silu_and_mul_ref(x))


@triton.jit
def _per_token_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, a_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr,
                                 HAS_AMAX: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_AMAX:
        amax = tl.load(a_ptr + row)
    else:
        amax = tl.max(tl.abs(x), axis=0)
    scale = tl.maximum(amax, 1e-12) / 448.0
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, K] (CUDA, last dim contiguous) -> (float8_e4m3fn [T, K], float32 scales [T, 1]);
    ``amax`` float32 [T, 1] (contiguous): each row's ``max|x|`` when ``x`` is a shard of it.

    Raises:
        ValueError: not 2-D, last dim not contiguous, K > 32768, or ``amax`` not float32 [T, 1].
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be 2-D with a contiguous last dimension")
    T, K = x.shape
    if K > 32768:
        raise ValueError(f"rows up to 32768 wide, got {K}")
    if amax is not None and (amax.shape != (T, 1) or amax.dtype != torch.float32 or not amax.is_contiguous()):
        raise ValueError(f"amax must be contiguous float32 [{T}, 1], got {amax.dtype} {tuple(amax.shape)}")
    q = torch.empty((T, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    if T:
        block = triton.next_power_of_2(K)
        _per_token_quant_fp8_kernel[(T,)](x, q, s, s if amax is None else amax, K, x.stride(0), q.stride(0),
                                          BLOCK=block, HAS_AMAX=amax is not None,
                                          num_warps=min(16, max(4, block // 1024)))
    return q, s


@triton.jit
def _silu_and_mul_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, inter, stride_xm, stride_qm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_xm + inter + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    # rounded to the input dtype as silu_and_mul stores it, then quantized from that value
    y = (g / (1.0 + tl.exp(-g)) * up).to(gate.dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU then per-token FP8: ``x`` [T, 2I] float16/bfloat16 (CUDA, last dim contiguous) ->
    (float8_e4m3fn [T, I], float32 scales [T, 1]); bit-identical to
    ``per_token_quant_fp8(silu_and_mul(x))``.

    Raises:
        ValueError: not 2-D, odd or over 65536 wide, a float32 input, or the last dim not
            contiguous.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be 2-D with a contiguous last dimension")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    T, two_i = x.shape
    if two_i % 2 or two_i > 65536:
        raise ValueError(f"x must be [T, 2 * I] with I up to 32768, got {tuple(x.shape)}")
    inter = two_i // 2
    q = torch.empty((T, inter), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    if T:
        block = triton.next_power_of_2(inter)
        _silu_and_mul_quant_fp8_kernel[(T,)](x, q, s, inter, x.stride(0), q.stride(0), BLOCK=block,
                                             num_warps=min(16, max(4, block // 1024)))
    return q, s
