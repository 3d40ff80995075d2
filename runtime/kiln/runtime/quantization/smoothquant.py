"""``int8-smoothquant``: W8A8 INT8 after SmoothQuant's difficulty migration.

SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models", ICML 2023): activations of LLMs have a few outlier channels that make
per-token INT8 lossy, while weights are easy to quantize.  With per-input-channel factors

    s[k] = max|X[:, k]|^alpha / max|W[:, k]|^(1 - alpha)      (alpha = migration strength)

the product is unchanged, ``X W^T = (X / s)(W * s)^T``, and both factors quantize well.
``max|X|`` comes from calibration text.  ``1 / s`` is folded offline into the operation
that produces X: the RMSNorm weights before the QKV and gate-up projections, the up-projection
rows before the down projection (``silu(gate) * up / s``).  The output projection's input
(attention output) has no foldable producer under grouped-query attention, so it keeps a
runtime vector ``smooth_inv`` [K].

Weights: ``weight`` int8 [N, K] with float32 ``weight_scale`` [N] (symmetric per output
channel, max/127).  Activations: symmetric per-token INT8 at run time.  GEMM:
``torch._int_mm`` (int8 x int8 -> int32 tensor cores) on CUDA with the scales applied in
float32 after; on the CPU the same numerics through a float matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import LinearMethod, QuantHandler, QuantSettings, cached_dequant, replace_weight

RUNTIME_SMOOTHED = ("o_proj",)  # linears whose smoothing factor is applied at run time


def quantize_rows_int8(t: torch.Tensor, full_range: bool = False,
                       amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8: ``t`` float [R, C] -> (int8 [R, C], float32 scales [R, 1]).

    ``scale = max|t[r, :]| / 127`` and codes in -127..127 (Kiln's and vLLM's grid), or with
    ``full_range`` compressed-tensors' definition of a symmetric 8-bit scheme, ``max|t| / 127.5``
    with codes clamped to -128..127 (``calculate_qparams``: half the bit range), the grid an
    llm-compressor ``W8A8`` checkpoint was calibrated against.  ``amax`` float32 [R, 1] replaces
    ``max|t[r, :]|`` when ``t`` is one shard of wider rows (a row-parallel layer's input)."""
    if amax is None:
        amax = t.abs().amax(dim=-1, keepdim=True)
    amax = amax.float().clamp(min=1e-12)
    scale = amax / (127.5 if full_range else 127.0)
    q = torch.round(t.float() / scale).clamp(-128 if full_range else -127, 127).to(torch.int8)
    return q, scale


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors ``s`` float32 [K] (see the module doc).

    Args:
        act_absmax: float32 [K] max |x| per input channel over calibration tokens.
        weight: float [N, K] (for fused projections, all outputs that share the input).
        alpha: migration strength in [0, 1] (0.5 in the paper for most models).
    """
    a = act_absmax.float().clamp(min=1e-5)
    w = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)


def smooth_layer(layer, stats, alpha: float, names=("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")) -> dict:
    """Migrate activation outliers into the weights of one decoder layer, folding ``1 / s`` into
    the producer of each input (exact in float arithmetic):

    * ``self_attn.qkv_proj``: the input RMSNorm's weights;
    * ``mlp.gate_up_proj``: the post-attention RMSNorm's weights;
    * ``mlp.down_proj``: the up-projection rows (``silu(gate) * up / s``).

    Args:
        layer: a ``LlamaDecoderLayer`` (float weights, changed in place).
        stats: ``LayerStats`` with ``absmax`` keyed by linear name.
        alpha: migration strength.
        names: which of the three inputs to smooth.
    Returns:
        ``{name: s}`` float32 [K] factors applied.
    """
    attn, mlp = layer.self_attn, layer.mlp
    out = {}
    with torch.no_grad():
        if "self_attn.qkv_proj" in names:
            s = smoothing_factors(stats["self_attn.qkv_proj"].absmax, attn.qkv_proj.weight, alpha)
            attn.qkv_proj.weight.mul_(s)
            layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
            out["self_attn.qkv_proj"] = s
        if "mlp.gate_up_proj" in names:
            s = smoothing_factors(stats["mlp.gate_up_proj"].absmax, mlp.gate_up_proj.weight, alpha)
            mlp.gate_up_proj.weight.mul_(s)
            layer.post_attention_layernorm.weight.div_(s)
            out["mlp.gate_up_proj"] = s
        if "mlp.down_proj" in names:
            s = smoothing_factors(stats["mlp.down_proj"].absmax, mlp.down_proj.weight, alpha)
            mlp.down_proj.weight.mul_(s)
            inter = mlp.gate_up_proj.weight.shape[0] // 2
            mlp.gate_up_proj.weight[inter:].div_(s[:, None])
            out["mlp.down_proj"] = s
    return out


class Int8LinearMethod(LinearMethod):
    name = "int8-smoothquant"

    def __init__(self, runtime_smooth: bool = False, full_range: bool = False):
        self.runtime_smooth = runtime_smooth
        self.full_range = full_range  # activations on compressed-tensors' grid (quantize_rows_int8)

    def create_weights(self, layer, name: str) -> None:
        N, K = layer.weight.shape
        dev = layer.weight.device
        bufs = {"weight": torch.empty(N, K, dtype=torch.int8, device=dev),
                "weight_scale": torch.empty(N, dtype=torch.float32, device=dev)}
        if self.runtime_smooth:
            bufs["smooth_inv"] = torch.empty(K, dtype=torch.float32, device=dev)
        replace_weight(layer, bufs)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        if self.runtime_smooth:
            x = x * layer.smooth_inv.to(x.dtype)
        xq, xs = quantize_rows_int8(x, self.full_range, layer.full_row_absmax(x))
        if x.is_cuda and x.dtype != torch.float32:
            T = xq.shape[0]
            if T <= 16:  # torch._int_mm needs more than 16 rows
                xq = torch.cat([xq, xq.new_zeros(17 - T, xq.shape[1])])
            acc = torch._int_mm(xq, layer.weight.t())[:T]  # int32 [T, N]
            y = (acc.float() * xs * layer.weight_scale).to(x.dtype)
            return y if layer.bias is None else y + layer.bias
        w = cached_dequant(layer, lambda: (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype))
        return F.linear((xq.float() * xs).to(x.dtype), w, layer.bias)


class SmoothQuantHandler(QuantHandler):
    """Calibrated smoothing (``absmax`` statistics), then per-channel INT8 weights."""

    needs_calibration = True
    wants = frozenset({"absmax"})

    def quantize_layer(self, layer, prefix, stats) -> None:
        alpha = float(self.settings.alpha)
        attn, mlp = layer.self_attn, layer.mlp
        smooth_layer(layer, stats, alpha)
        with torch.no_grad():
            s_o = smoothing_factors(stats["self_attn.o_proj"].absmax, attn.o_proj.weight, alpha)
            attn.o_proj.weight.mul_(s_o)

            for mod, smooth_inv in ((attn.qkv_proj, None), (attn.o_proj, 1.0 / s_o),
                                    (mlp.gate_up_proj, None), (mlp.down_proj, None)):
                q, sc = quantize_rows_int8(mod.weight.data)
                bufs = {"weight": q, "weight_scale": sc.view(-1)}
                if smooth_inv is not None:
                    bufs["smooth_inv"] = smooth_inv.float()
                replace_weight(mod, bufs)
                mod.quant_method = Int8LinearMethod(runtime_smooth=smooth_inv is not None)
