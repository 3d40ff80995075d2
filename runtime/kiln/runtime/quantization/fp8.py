"""``fp8``: W8A8 FP8 (E4M3) with per-output-channel weight scales and dynamic per-token
activation scales.

Weights: ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` float32 [N] with
``W ≈ weight * weight_scale[:, None]`` (``scale = max|W[n, :]| / 448``, 448 being E4M3's
largest finite value).  Activations are quantized per token at run time
(``scale = max|x[t, :]| / 448``).  No calibration.  This is the FP8 recipe of
Micikevicius et al., "FP8 Formats for Deep Learning" (2022), in its per-channel/per-token
("rowwise") form used by vLLM and TensorRT-LLM.

GEMM: ``torch._scaled_mm`` with rowwise scales on CUDA (Hopper's FP8 tensor cores); on the
CPU (and for float32 activations) the same quantize-dequantize numerics through a float matmul,
so CPU accuracy numbers are the GPU's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import LinearMethod, QuantHandler, QuantSettings, decoder_linears, register, replace_weight

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_rows_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row FP8 quantization.

    Args:
        t: float [R, C].
    Returns:
        (float8_e4m3fn [R, C], float32 scales [R, 1]) with ``t ≈ q * scale``.
    """
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def cached_dequant(layer, make) -> torch.Tensor:
    """A dequantized weight kept on the layer for the CPU path, rebuilt when the stored
    weight changes (keyed on the buffer's identity and version counter)."""
    src = layer.weight if hasattr(layer, "weight") and layer.weight is not None else layer.qweight
    key = (src.data_ptr(), src._version, src.device)
    hit = getattr(layer, "_kiln_dequant", None)
    if hit is None or hit[0] != key:
        hit = (key, make())
        layer._kiln_dequant = hit
    return hit[1]


def _scaled_mm_ok(x: torch.Tensor, layer) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and layer.weight.shape[1] % 16 == 0
            and layer.weight.shape[0] % 16 == 0)


class Fp8LinearMethod(LinearMethod):
    name = "fp8"

    def create_weights(self, layer, name: str) -> None:
        N, K = layer.weight.shape
        dev = layer.weight.device
        replace_weight(layer, {"weight": torch.empty(N, K, dtype=FP8, device=dev),
                               "weight_scale": torch.empty(N, dtype=torch.float32, device=dev)})

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        if _scaled_mm_ok(x, layer):
            xq, xs = _quant_kernel()(x.contiguous())
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale.view(1, -1),
                                 out_dtype=x.dtype)
            return y if layer.bias is None else y + layer.bias
        xq, xs = quantize_rows_fp8(x)
        w = cached_dequant(layer, lambda: (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype))
        return F.linear((xq.float() * xs).to(x.dtype), w, layer.bias)


def _quant_kernel():
    """The fused per-token quantizer (``kiln.kernels.fp8_quant``), or the torch one."""
    try:
        from kiln.kernels.fp8_quant import per_token_quant_fp8  # noqa: PLC0415
    except Exception:  # pragma: no cover - kernels unavailable
        return quantize_rows_fp8
    return per_token_quant_fp8


class Fp8Handler(QuantHandler):
    """Per-channel FP8 weights; nothing to calibrate."""

    def quantize_layer(self, layer, prefix, stats) -> None:
        for _, mod in decoder_linears(layer):
            q, s = quantize_rows_fp8(mod.weight.data.float())
            replace_weight(mod, {"weight": q, "weight_scale": s.view(-1)})
            mod.quant_method = Fp8LinearMethod()

    def linear_method(self):
        return Fp8LinearMethod()


register("fp8", Fp8Handler, lambda settings, name: Fp8LinearMethod())
