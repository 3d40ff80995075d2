"""The int4 weight format shared by AWQ and GPTQ (and read by the W4A16 GEMM).

A linear layer's weight ``W`` ([N out, K in] floats) is stored as, with group size ``G``
(columns of ``K`` that share one scale and zero point; ``K % G == 0``, ``K % 64 == 0``,
``G % 8 == 0``):

* ``qweight`` int32 ``[K // 8, N]``: eight 4-bit values packed along K, interleaved in
  blocks of 64 columns: bits ``4i..4i+3`` of ``qweight[8b + r, n]`` hold ``q[n, 64b + 8i + r]``
  (unsigned, 0..15; ``r < 8``).  Packing along K keeps a GEMM's loads along N contiguous; the
  interleave makes nibble ``i`` of a block's eight rows eight contiguous K columns (one vector
  load of the activations per nibble in the W4A16 kernel).
* ``scales`` float16 ``[K // G, N]`` (half the bytes of float32: 4.7 % of the int4 bytes
  with the zero points at G = 128 instead of 7.8 %).
* ``qzeros`` uint8 ``[K // G, N]`` (0..15).

and dequantizes as ``W[n, k] = (q[n, k] - qzeros[k // G, n]) * scales[k // G, n]``
(asymmetric min/max quantization, as in AWQ and GPTQ).  Pure torch, device-agnostic.
"""

from __future__ import annotations

import os

import torch

PACK = 8  # int4 values per int32
KBLOCK = 64  # K columns per interleave block (kiln.kernels.w4a16.KBLOCK)
SCALE_DTYPE = torch.float16


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
    N, K = w.shape
    s = scales.repeat_interleave(group_size, dim=1)
    z = zeros.repeat_interleave(group_size, dim=1)
    return torch.clamp(torch.round(w.float() / s) + z, 0, 15).to(torch.int32)


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round-trip ``w`` [N, K] through int4 with min/max group parameters (float32 result)."""
    s, z = quantize_params(w, group_size)
    q = quantize_with(w, s, z, group_size)
    return (q.float() - z.repeat_interleave(group_size, 1)) * s.repeat_interleave(group_size, 1)


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pack integer codes into the storage format.

    Args:
        q: int [N, K] codes 0..15 (K divisible by 8).
        scales, zeros: [N, K // G] per-group parameters.
    Returns:
        ``{"qweight": int32 [K//8, N], "scales": float16 [K//G, N], "qzeros": uint8 [K//G, N]}``.
    """
    N, K = q.shape
    if K % KBLOCK:
        raise ValueError(f"int4 packing needs in_features divisible by {KBLOCK}, got {K}")
    # k = 64b + 8i + r -> packed row 8b + r, nibble i
    qt = q.to(torch.int64).t().reshape(K // KBLOCK, PACK, PACK, N).transpose(1, 2).reshape(K // PACK, PACK, N)
    shifts = (torch.arange(PACK, dtype=torch.int64, device=q.device) * 4).view(1, PACK, 1)
    v = (qt << shifts).sum(dim=1)  # [K/8, N], 0 .. 2^32-1
    v = torch.where(v >= 2**31, v - 2**32, v)
    return {
        "qweight": v.to(torch.int32).contiguous(),
        "scales": scales.t().to(SCALE_DTYPE).contiguous(),
        "qzeros": zeros.t().to(torch.uint8).contiguous(),
    }


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    """Integer codes int32 [N, K] from ``qweight`` int32 [K//8, N]."""
    K8, N = qweight.shape
    shifts = (torch.arange(PACK, dtype=torch.int32, device=qweight.device) * 4).view(1, PACK, 1)
    q = (qweight.unsqueeze(1) >> shifts) & 0xF  # [K/8, 8 (nibble i), N], row 8b + r
    q = q.reshape(K8 // PACK, PACK, PACK, N).transpose(1, 2)  # [K/64, 8 (i), 8 (r), N]: k = 64b + 8i + r
    return q.reshape(K8 * PACK, N).t().contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The float weight [N, K] in ``dtype`` from the packed format (see the module doc)."""
    q = unpack(qweight)  # [N, K]
    N, K = q.shape
    G = K // scales.shape[0]
    s = scales.float().t().repeat_interleave(G, dim=1)
    z = qzeros.float().t().repeat_interleave(G, dim=1)
    return ((q.float() - z) * s).to(dtype)


# -- serving -------------------------------------------------------------------------------
import torch.nn.functional as F  # noqa: E402

from .base import LinearMethod, replace_weight  # noqa: E402


class Int4LinearMethod(LinearMethod):
    """W4A16 serving of the packed format: the Triton GEMM (``kiln.kernels.w4a16``, dequant
    in registers, a CUDA-core GEMV for M <= 4, split-K in one launch for small batches) on CUDA; a cached dequantized weight and a float
    matmul on the CPU.

    Args:
        group_size: columns per scale group (the layer's K must be a multiple).
    """

    name = "int4"

    def __init__(self, group_size: int):
        self.group_size = group_size
        cuda_layout()  # a bad KILN_W4A16_LAYOUT is reported when the engine loads, on any device

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
            from kiln.kernels.w4a16 import w4a16_gemm  # noqa: PLC0415

            if cuda_layout() == "kmajor":
                to_kmajor_(layer)
            y = w4a16_gemm(x, layer.qweight, layer.scales, layer.qzeros, out_dtype=out_dtype)
            return y if layer.bias is None else y + layer.bias
        from .fp8 import cached_dequant  # noqa: PLC0415

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
        from kiln.kernels.w4a16 import w4a16_gemm  # noqa: PLC0415

        if cuda_layout() == "kmajor":
            to_kmajor_(layer)
        return w4a16_gemm(x, layer.qweight, layer.scales, layer.qzeros, silu_and_mul=True)


def cuda_layout() -> str:
    """How the packed buffers are stored on CUDA for serving, from ``KILN_W4A16_LAYOUT``:
    ``"nmajor"`` (default: the checkpoint layout) or ``"kmajor"`` (each output column's packed
    words contiguous, what ``kiln.kernels.w4a16_gemvt`` streams: the same ``[K // 8, N]``
    tensors with strides ``(1, K // 8)``).  H200, Llama-3.1-8B projections (session 8,
    docs/benchmarks.md): N-major is faster at M = 1, 2 (the batch-1 decode), K-major at M = 4
    (1.03-1.26x, the swap kernel), so the default is N-major.

    Raises:
        ValueError: any other value.
    """
    v = os.environ.get("KILN_W4A16_LAYOUT", "nmajor").strip().lower() or "nmajor"
    if v not in ("kmajor", "nmajor"):
        raise ValueError(f"KILN_W4A16_LAYOUT must be kmajor or nmajor, got {v!r}")
    return v


def to_kmajor_(layer) -> bool:
    """Store ``layer``'s ``qweight``, ``scales`` and ``qzeros`` K-major in place (same values,
    same shapes; a one-time copy per buffer, done on the first CUDA call, which the engine makes
    in its eager warm-up before any CUDA graph is captured).  Saving is unaffected: the engine
    writer stores ``.contiguous()`` copies.  Returns True when something was converted; never
    converts inside a CUDA graph capture (the copy would be recorded into the graph)."""
    from kiln.kernels.w4a16 import is_kmajor, to_kmajor  # noqa: PLC0415

    if is_kmajor(layer.qweight) or layer.qweight.shape[1] <= 1 or (
            layer.qweight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    with torch.no_grad():
        for name in ("qweight", "scales", "qzeros"):
            setattr(layer, name, to_kmajor(getattr(layer, name)))
    return True


def store_int4(layer, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    """Replace ``layer.weight`` by the packed int4 buffers and install ``Int4LinearMethod``.

    Args:
        q: int [N, K] codes; scales, zeros: [N, K // G].
    """
    replace_weight(layer, pack(q, scales, zeros))
    layer.quant_method = Int4LinearMethod(group_size)
