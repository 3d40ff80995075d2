"""The packed int4 weight format (Kiln's "format 2"), defined once: torch only, no Triton.

Written by ``kiln build`` (AWQ, GPTQ: ``kiln.runtime.quantization.int4``) and read by the
W4A16 kernels (``kiln.kernels.w4a16``) and the CPU path.  A linear layer's weight ``W``
([N out, K in] floats) is stored, with group size ``G`` (columns of K that share one scale
and zero point; ``K % G == 0``, ``K % 64 == 0``, ``G % 8 == 0``), as:

* ``qweight`` int32 ``[K // 8, N]``: eight 4-bit codes (0..15) packed along K, interleaved in
  blocks of ``KBLOCK`` = 64 columns: bits ``4i..4i+3`` of ``qweight[8b + r, n]`` hold the code
  of ``W[n, 64b + 8i + r]`` (``r < 8``).  Packing along K keeps a GEMM's loads along N
  contiguous; the interleave makes nibble ``i`` of a block's eight rows eight contiguous K
  columns (one vector load of the activations per nibble), and a group boundary (a
  multiple of 8) never falls inside a packed row;
* ``scales`` float16 ``[K // G, N]`` (half the bytes of float32: 4.7 % of the int4 bytes with
  the zero points at G = 128 instead of 7.8 %);
* ``qzeros`` uint8 ``[K // G, N]`` (0..15);

and ``W[n, k] = (code[n, k] - qzeros[k // G, n]) * scales[k // G, n]`` (asymmetric min/max
quantization, as in AWQ and GPTQ).  Device-agnostic.
"""

from __future__ import annotations

import torch

__all__ = ["PACK", "KBLOCK", "SCALE_DTYPE", "pack", "unpack", "dequantize"]

PACK = 8  # int4 codes per int32
KBLOCK = 64  # K columns per interleave block
SCALE_DTYPE = torch.float16


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pack integer codes into the storage format.

    Args:
        q: int [N, K] codes 0..15.
        scales, zeros: [N, K // G] per-group parameters (any float / integer-valued dtype).
    Returns:
        ``{"qweight": int32 [K//8, N], "scales": float16 [K//G, N], "qzeros": uint8 [K//G, N]}``,
        each contiguous.
    Raises:
        ValueError: K not a multiple of ``KBLOCK``.
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
    """Integer codes int32 [N, K] from ``qweight`` int32 [K // 8, N] (any strides)."""
    K8, N = qweight.shape
    shifts = (torch.arange(PACK, dtype=torch.int32, device=qweight.device) * 4).view(1, PACK, 1)
    q = (qweight.unsqueeze(1) >> shifts) & 0xF  # [K/8, 8 (nibble i), N], row 8b + r
    q = q.reshape(K8 // PACK, PACK, PACK, N).transpose(1, 2)  # [K/64, 8 (i), 8 (r), N]: k = 64b + 8i + r
    return q.reshape(K8 * PACK, N).t().contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``W`` [N, K] in ``dtype`` (computed in float32, rounded once) from the
    packed tensors ``qweight`` int32 [K // 8, N], ``scales`` float [K // G, N], ``qzeros``
    uint8 [K // G, N]."""
    q = unpack(qweight)  # [N, K]
    G = q.shape[1] // scales.shape[0]
    s = scales.float().t().repeat_interleave(G, dim=1)
    z = qzeros.float().t().repeat_interleave(G, dim=1)
    return ((q.float() - z) * s).to(dtype)
