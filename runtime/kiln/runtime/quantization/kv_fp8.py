"""``--kv-cache-dtype fp8``: an FP8 (E4M3) KV cache with calibrated per-layer scales.

During calibration the largest |K| (after RoPE) and |V| that each layer writes to its cache
are measured on the calibration text; the stored scale is ``max / 448`` so the observed range
maps onto E4M3's finite range (per-tensor static scaling, as in vLLM's and TensorRT-LLM's FP8
KV caches; FP8 formats: Micikevicius et al., 2022).  The cache stores ``clamp(x / scale)``
in float8_e4m3fn and attention reads ``q . (k_fp8 * k_scale)``; the paged attention kernels
and the torch backend take the scales (``PagedAttention.k_scale`` / ``v_scale``).

Engine tensors: ``model.layers.<i>.self_attn.attn.k_scale`` / ``v_scale``, float32 [1].
"""

from __future__ import annotations

import torch
from torch import nn

FP8_MAX = 448.0
KV_DTYPE = torch.float8_e4m3fn


def scale_tensors(kv_absmax: list[tuple[float, float]]) -> dict[str, torch.Tensor]:
    """Engine tensors of the per-layer scales from measured ``(max|K|, max|V|)``."""
    out = {}
    for i, (k, v) in enumerate(kv_absmax):
        out[f"model.layers.{i}.self_attn.attn.k_scale"] = torch.tensor([max(k, 1e-6) / FP8_MAX], dtype=torch.float32)
        out[f"model.layers.{i}.self_attn.attn.v_scale"] = torch.tensor([max(v, 1e-6) / FP8_MAX], dtype=torch.float32)
    return out


def install_scales(model: nn.Module, tensors: dict[str, torch.Tensor], device) -> None:
    """Set each ``PagedAttention``'s ``k_scale``/``v_scale`` from engine tensors.

    Raises:
        KeyError: a layer's scale is missing from ``tensors``.
    """
    for i, attn in enumerate(model.attention_layers()):
        attn.k_scale = tensors[f"model.layers.{i}.self_attn.attn.k_scale"].to(device=device, dtype=torch.float32)
        attn.v_scale = tensors[f"model.layers.{i}.self_attn.attn.v_scale"].to(device=device, dtype=torch.float32)
