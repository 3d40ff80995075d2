"""The int4 weights of AWQ and GPTQ: min/max group parameters, and their serving method.

The storage format (``qweight`` / ``scales`` / ``qzeros``, the 64-column interleave) is
``kiln.kernels.int4_format``, defined once and shared with the W4A16 kernels; this module
re-exports its names (``PACK``, ``KBLOCK``, ``SCALE_DTYPE``, ``pack``, ``unpack``,
``dequantize``) for the quantizers.  Pure torch on the build side, device-agnostic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.int4_format import KBLOCK, PACK, SCALE_DTYPE, dequantize, pack, unpack

from .base import LinearMethod, cached_dequant, replace_weight

__all__ = ["PACK", "KBLOCK", "SCALE_DTYPE", "pack", "unpack", "dequantize", "quantize_params", "quantize_with",
           "fake_quantize", "Int4LinearMethod", "store_int4"]


def quantize_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit scale and zero point of each group of ``w`` (min/max rule).

    Args:
        w: float [N, K] weights (K divisible by ``group_size``).
    Returns:
        scales float32 [N, K // G] (> 0, float16 values) and zeros float32 [N, K // G] (integers 0..15).
    """
    N, K = w.shape
    g = w.float().reshape(N, K // group_size, group_size)
    wmax = g.amax(dim=2).clamp(min=0)
    wmin = g.amin(dim=2).clamp(max=0)
    # rounded to the stored float16 (the smallest positive subnormal is 6e-8)
    scales = ((wmax - wmin) / 15).clamp(min=1e-7, max=65504.0).to(SCALE_DTYPE).float()
    zeros = torch.round(-wmin / scales).clamp(0, 15)
    return scales, zeros


def quantize_with(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Integer codes 0..15 of ``w`` [N, K] for per-group ``scales``/``zeros`` [N, K // G] (int32)."""
    s = scales.repeat_interleave(group_size, dim=1)
    z = zeros.repeat_interleave(group_size, dim=1)
    return torch.clamp(torch.round(w.float() / s) + z, 0, 15).to(torch.int32)


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round-trip ``w`` [N, K] through int4 with min/max group parameters (float32 result)."""
    s, z = quantize_params(w, group_size)
    q = quantize_with(w, s, z, group_size)
    return (q.float() - z.repeat_interleave(group_size, 1)) * s.repeat_interleave(group_size, 1)


class Int4LinearMethod(LinearMethod):
    """W4A16 serving of the packed format: the Triton GEMM (``kiln.kernels.w4a16``: dequant in
    registers, CUDA-core GEMVs for M <= 4, split-K in one launch for small batches) on CUDA,
    launched with the layer's ``kernel_options``; a cached dequantized weight and a float
    matmul on the CPU.

    Args:
        group_size: columns per scale group (the layer's K must be a multiple).
    """

    name = "int4"

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer, name: str) -> None:
        N, K = layer.weight.shape
        G = self.group_size
        dev = layer.weight.device
        replace_weight(layer, {"qweight": torch.empty(K // PACK, N, dtype=torch.int32, device=dev),
                               "scales": torch.empty(K // G, N, dtype=SCALE_DTYPE, device=dev),
                               "qzeros": torch.empty(K // G, N, dtype=torch.uint8, device=dev)})

    def apply(self, layer, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x`` [T, K] (model dtype) -> [T, N] in ``out_dtype`` (default x's; the LM head asks
        for float32 logits, which the GEMM writes directly)."""
        if x.is_cuda:
            from kiln.kernels.w4a16 import w4a16_gemm  # noqa: PLC0415  (Triton: CUDA only)

            y = w4a16_gemm(x, layer.qweight, layer.scales, layer.qzeros, out_dtype=out_dtype,
                           options=layer.kernel_options)
            return y if layer.bias is None else y + layer.bias
        w = cached_dequant(layer, lambda: dequantize(layer.qweight, layer.scales, layer.qzeros, x.dtype))
        y = F.linear(x, w, layer.bias)
        return y if out_dtype is None else y.to(out_dtype)

    def apply_silu_and_mul(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        """SwiGLU of a fused gate|up layer: ``x`` [T, K] -> ``silu(gate) * up`` [T, I] with the
        activation in the W4A16 GEMV's epilogue (``w4a16_gemm(..., silu_and_mul=True)``; it
        falls back to the GEMM and ``silu_and_mul`` where it cannot fuse); None (the caller runs
        the layer, then the activation) off CUDA or for a layer with a bias."""
        if not x.is_cuda or layer.bias is not None:
            return None
        from kiln.kernels.w4a16 import w4a16_gemm  # noqa: PLC0415  (Triton: CUDA only)

        return w4a16_gemm(x, layer.qweight, layer.scales, layer.qzeros, silu_and_mul=True,
                          options=layer.kernel_options)


def store_int4(layer, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    """Replace ``layer.weight`` by the packed int4 buffers and install ``Int4LinearMethod``.

    Args:
        q: int [N, K] codes; scales, zeros: [N, K // G].
    """
    replace_weight(layer, pack(q, scales, zeros))
    layer.quant_method = Int4LinearMethod(group_size)
