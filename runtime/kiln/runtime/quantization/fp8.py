"""``fp8``: W8A8 FP8 (E4M3) with per-output-channel weight scales and dynamic per-token
activation scales.

Weights: ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` float32 [N] with
``W ≈ weight * weight_scale[:, None]``.  Activations are quantized per token at run time
(``scale = max|x[t, :]| / 448``, 448 being E4M3's largest finite value).  This is the FP8
recipe of Micikevicius et al., "FP8 Formats for Deep Learning" (2022), in its
per-channel/per-token ("rowwise") form used by vLLM and TensorRT-LLM.

Building (calibrated, ``Fp8Handler``), per decoder layer:

1. SmoothQuant smoothing (Xiao et al., ICML 2023; ``smoothquant.smooth_layer``, alpha 0.5) of
   the QKV, gate-up and down inputs, folded exactly into the two RMSNorms and the up rows.  It
   changes nothing at run time but what the per-token FP8 quantizer sees: on SmolLM2-135M the
   activations' share of the perplexity rise fell from +1.37% to +0.83%.
2. GPTQ (Frantar et al., ICLR 2023) with the E4M3 grid in place of the int4 one, as
   llm-compressor's ``GPTQModifier`` offers for FP8 schemes (``gptq_fp8``): each row's scale
   is fixed first by a search over one octave above ``max|w| / 448`` (``search_row_scales``),
   then columns are rounded one at a time and each rounding error is spread over the columns
   not yet rounded through the inverse Hessian of the layer's calibration inputs
   (``gptq.gptq_sweep``), linears in GPTQ's "true sequential" order.  The weights' share fell
   from +1.9% (round to nearest with ``max|w| / 448``) to +0.1-0.4%.

Together: +0.94% perplexity against float32 instead of +2.91% (docs/benchmarks.md).
``settings.extra``: ``fp8_alpha`` (0 disables smoothing), ``fp8_weights = "rtn"`` (round to
nearest with absmax scales), ``damp``.

GEMM: ``torch._scaled_mm`` with rowwise scales on CUDA (Hopper's FP8 tensor cores) and fast
accumulation (``use_fast_accum``: partial sums stay in the tensor cores' accumulator instead
of being promoted to float32 every few k-blocks; the inference setting of vLLM's CUTLASS
``...FP8FastAccum`` schedules).  H200, Llama-3.1-8B shapes, M = 1024-8192: 1.65-2.15x bf16
instead of 1.53-1.86x, relative error against float32 of the quantized operands 2.1e-3
(3.3e-3 at K = 14336) instead of 1.7e-3 (docs/benchmarks.md).  On the CPU (and for float32
activations) the same quantize-dequantize numerics through a float matmul, so CPU accuracy
numbers are the GPU's up to that accumulation difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.reference import per_token_quant_fp8_ref

from .base import TRUE_SEQUENTIAL, LinearMethod, QuantHandler, QuantSettings, cached_dequant, decoder_linears, \
    replace_weight
from .gptq import gptq_sweep
from .smoothquant import smooth_layer

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_GRID = 16  # candidate scales per octave in search_row_scales
DAMP = 0.01  # GPTQ dampening (fraction of mean diag H)
SMOOTH_ALPHA = 0.5  # SmoothQuant migration strength of the folded smoothing


# Symmetric per-row FP8: float [R, C] (and optionally the rows' max |t|, float32 [R, 1]) ->
# (float8_e4m3fn [R, C], float32 scales [R, 1]) with ``t ≈ q * scale``; the one torch version of
# the per-token quantizer (``kiln.kernels.reference``).
quantize_rows_fp8 = per_token_quant_fp8_ref


def _scaled_mm_ok(x: torch.Tensor, layer) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and layer.weight.shape[1] % 16 == 0
            and layer.weight.shape[0] % 16 == 0)


class Fp8LinearMethod(LinearMethod):
    name = "fp8"
    # the input may arrive quantized by the norm before the layer (RMSNorm.forward(quant_for=))
    accepts_prequantized = True

    def create_weights(self, layer, name: str) -> None:
        N, K = layer.weight.shape
        dev = layer.weight.device
        replace_weight(layer, {"weight": torch.empty(N, K, dtype=FP8, device=dev),
                               "weight_scale": torch.empty(N, dtype=torch.float32, device=dev)})

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        pre = layer.take_prequantized(x)  # (q, scales) of x from the norm's kernel, if it made them
        amax = layer.full_row_absmax(x)  # a row-parallel shard: the whole row's max (TP = 1's scale)
        if _scaled_mm_ok(x, layer):
            xq, xs = pre if pre is not None and amax is None else _quant_kernel()(x.contiguous(), amax)
            return _scaled_gemm(xq, xs, layer, x.dtype)
        xq, xs = quantize_rows_fp8(x, amax)
        w = cached_dequant(layer, lambda: (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype))
        return F.linear((xq.float() * xs).to(x.dtype), w, layer.bias)

    def apply_after_swiglu(self, layer, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``layer(silu_and_mul(gate_up))`` with SwiGLU and the activation quantization in one
        kernel (``kiln.kernels.fp8_quant.silu_and_mul_quant_fp8``, bit-identical to the two
        kernels); None where the fused kernel does not apply (the CPU, float32, a row-parallel
        shard at tensor-parallel size > 1, whose scale needs the whole row's max)."""
        if layer.tp_size > 1 or not _scaled_mm_ok(gate_up[:, : gate_up.shape[1] // 2], layer):
            return None
        try:
            from kiln.kernels.fp8_quant import silu_and_mul_quant_fp8  # noqa: PLC0415
        except Exception:  # pragma: no cover - kernels unavailable
            return None
        xq, xs = silu_and_mul_quant_fp8(gate_up)
        return _scaled_gemm(xq, xs, layer, gate_up.dtype)


def _scaled_gemm(xq: torch.Tensor, xs: torch.Tensor, layer, out_dtype: torch.dtype) -> torch.Tensor:
    """``xq`` float8 [T, K] (per-token scales ``xs`` float32 [T, 1]) times the layer's FP8
    weight on the tensor cores (``torch._scaled_mm``, fast accumulation), plus its bias:
    [T, N] in ``out_dtype``."""
    y = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale.view(1, -1),
                         out_dtype=out_dtype, use_fast_accum=True)
    return y if layer.bias is None else y + layer.bias


def _quant_kernel():
    """The fused per-token quantizer (``kiln.kernels.fp8_quant``), or the torch one."""
    try:
        from kiln.kernels.fp8_quant import per_token_quant_fp8  # noqa: PLC0415
    except Exception:  # pragma: no cover - kernels unavailable
        return quantize_rows_fp8
    return per_token_quant_fp8


def fp8_round(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the scaled E4M3 grid (float32, same shape): ``fp8(t / scale) * scale``
    with saturation at +-448 (``scale`` broadcasts against ``t``)."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def search_row_scales(w: torch.Tensor, importance: torch.Tensor, num_grid: int = SCALE_GRID) -> torch.Tensor:
    """Per-row FP8 scales that minimize the input-weighted rounding error
    ``sum_k importance[k] * (w[n, k] - Q_s(w[n, k]))^2`` over ``s = max|w[n, :]| / 448 * 2^(j / num_grid)``,
    ``j = 0 .. num_grid - 1``.

    E4M3's error is relative (3 mantissa bits) so scales a factor 2 apart round alike; the grid
    spans one octave from the absmax scale (``j = 0``, no value clipped) and picks, per row,
    where the row's values fall relative to the representable points (the MSE range search of
    GPTQ's and llm-compressor's observers, with FP8's grid; here never clipping).

    Args:
        w: float [N, K].
        importance: float [K] >= 0 per input channel (``diag(H)``: mean x_k^2).
    Returns:
        float32 [N] scales.
    """
    base = w.abs().amax(dim=1).float().clamp(min=1e-12) / FP8_MAX  # [N]
    imp = importance.float().view(1, -1)
    best = torch.full_like(base, float("inf"))
    best_s = base.clone()
    for j in range(num_grid):
        s = base * 2.0 ** (j / num_grid)
        err = ((w.float() - fp8_round(w, s[:, None])).pow(2) * imp).sum(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        best_s = torch.where(better, s, best_s)
    return best_s


def gptq_fp8(w: torch.Tensor, hessian: torch.Tensor, damp: float = DAMP,
             scale_search: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 weights with per-output-channel scales by GPTQ error compensation.

    GPTQ (Frantar et al., ICLR 2023; ``gptq.gptq_sweep``) with the E4M3 grid in place of the
    int4 one, as llm-compressor's ``GPTQModifier`` does for its FP8 schemes: the per-row scales
    are fixed first (``search_row_scales``, or ``max|w| / 448``), then each column is rounded
    to the scaled E4M3 grid and its error spread over the columns not yet rounded through the
    inverse Hessian of ``||X W^T - X Q^T||^2``.  The stored format is unchanged (E4M3 codes and
    one float32 scale per output channel), so serving is not affected.

    Args:
        w: float [N, K].
        hessian: float [K, K], ``2/n * X^T X`` of the layer's calibration inputs.
    Returns:
        (float8_e4m3fn [N, K], float32 scales [N]).
    """
    W = w.float()
    scale = search_row_scales(W, torch.diag(hessian)) if scale_search else \
        W.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    deq = gptq_sweep(W, hessian, lambda col, k: fp8_round(col, scale), damp)
    codes = (deq / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # exact: deq is on the grid
    return codes, scale


class Fp8Handler(QuantHandler):
    """Calibrated FP8 weights; activations stay dynamic per token at run time.

    Per decoder layer: (1) SmoothQuant smoothing (``smoothquant.smooth_layer``, alpha 0.5) of
    the QKV, gate-up and down inputs, folded exactly into the two RMSNorms and the up rows
    (the output projection has no foldable producer under grouped-query attention and is not
    smoothed: the format has no runtime smoothing vector); (2) GPTQ with the E4M3 grid
    (``gptq_fp8``), "true sequential" (each linear's Hessian is collected with the linears
    before it in the layer already quantized).

    ``settings.extra``: ``fp8_alpha`` (migration strength; 0 disables smoothing) and
    ``fp8_weights`` (``"gptq"``, or ``"rtn"`` for round to nearest with ``max|w| / 448``).
    """

    needs_calibration = True
    wants = frozenset({"hessian"})
    sequential_groups = TRUE_SEQUENTIAL

    @property
    def alpha(self) -> float:
        return float(self.settings.extra.get("fp8_alpha", SMOOTH_ALPHA))

    @property
    def prepare_wants(self):
        return frozenset({"absmax"}) if self.alpha > 0 else frozenset()

    def prepare_layer(self, layer, prefix, stats) -> None:
        smooth_layer(layer, stats, self.alpha)

    def quantize_layer(self, layer, prefix, stats) -> None:
        rtn = self.settings.extra.get("fp8_weights", "gptq") == "rtn"
        damp = float(self.settings.extra.get("damp", DAMP))
        with torch.no_grad():
            for name, mod in decoder_linears(layer):
                if stats is not None and name not in stats:
                    continue  # another sequential group
                if rtn or stats is None:
                    q, s = quantize_rows_fp8(mod.weight.data.float())
                    s = s.view(-1)
                else:
                    q, s = gptq_fp8(mod.weight.data.float(), stats[name].hessian, damp)
                replace_weight(mod, {"weight": q, "weight_scale": s.contiguous()})
                mod.quant_method = Fp8LinearMethod()

    def linear_method(self):
        return Fp8LinearMethod()

