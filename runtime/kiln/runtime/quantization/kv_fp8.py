"""``--kv-cache-dtype fp8``: an FP8 (E4M3) KV cache with calibrated per-layer, per-KV-head scales.

During calibration the largest |K| (after RoPE) and |V| that each layer writes to its cache
are measured per KV head on the calibration text; the stored scale is ``max / 448`` so the
observed range maps onto E4M3's finite range (static scaling, as in vLLM's and TensorRT-LLM's
FP8 KV caches, here per head rather than per tensor; FP8 formats: Micikevicius et al., 2022).
Values beyond the calibrated range saturate at +-448.  The cache stores ``clamp(x / scale)``
in float8_e4m3fn and attention reads ``q . (k_fp8 * k_scale)``; the paged attention kernels
and the torch backend take the scales (``PagedAttention.k_scale`` / ``v_scale``).

Engine tensors: ``model.layers.<i>.self_attn.attn.k_scale`` / ``v_scale``, float32 [Hkv, 1]
(broadcast against ``[..., Hkv, D]``; the Triton kernels read them per head).
"""

from __future__ import annotations

import torch
from torch import nn

FP8_MAX = 448.0
KV_DTYPE = torch.float8_e4m3fn


def scale_tensors(kv_absmax: list) -> dict[str, torch.Tensor]:
    """Engine tensors of the scales from measured per-head ``(max|K|, max|V|)`` (float32 [Hkv])."""
    out = {}
    for i, (k, v) in enumerate(kv_absmax):
        out[f"model.layers.{i}.self_attn.attn.k_scale"] = (k.float().clamp(min=1e-6) / FP8_MAX).reshape(-1, 1).contiguous()
        out[f"model.layers.{i}.self_attn.attn.v_scale"] = (v.float().clamp(min=1e-6) / FP8_MAX).reshape(-1, 1).contiguous()
    return out


def install_scales(model: nn.Module, tensors: dict[str, torch.Tensor], device) -> None:
    """Set each ``PagedAttention``'s ``k_scale``/``v_scale`` from engine tensors.

    Raises:
        KeyError: a layer's scale is missing from ``tensors``.
    """
    for i, attn in enumerate(model.attention_layers()):
        attn.k_scale = tensors[f"model.layers.{i}.self_attn.attn.k_scale"].to(device=device, dtype=torch.float32)
        attn.v_scale = tensors[f"model.layers.{i}.self_attn.attn.v_scale"].to(device=device, dtype=torch.float32)


def install_dummy_scales(model: nn.Module, config, device) -> None:
    """KV scales for random weights (``load_format dummy``, normal with std 0.02, norms at 1).

    A projection of a normalized hidden state (RMS 1) with such weights has entries of standard
    deviation ``0.02 * sqrt(hidden_size)``; RoPE rotates pairs, so K keeps that spread.  The
    range is set at 6 standard deviations (larger values saturate at +-448): timing depends
    on the dtype, not on the scale, and no text is read from random weights.
    """
    layers = model.attention_layers()
    absmax = torch.full((layers[0].num_kv_heads,), 6.0 * 0.02 * float(config.hidden_size) ** 0.5)  # this rank's heads
    install_scales(model, scale_tensors([(absmax, absmax)] * len(layers)), device)
