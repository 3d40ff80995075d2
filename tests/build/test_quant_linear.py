"""Each method's serving path (``LinearMethod.apply``) against the float product it
approximates: on the CPU (dequantized matmuls) and, on a GPU, the real kernels
(``torch._scaled_mm``, ``torch._int_mm``, the Triton W4A16 GEMM) in bfloat16 against the CPU
path's numbers."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.model.layers import ReplicatedLinear
from kiln.runtime.quantization import int4
from kiln.runtime.quantization.fp8 import Fp8LinearMethod, quantize_rows_fp8
from kiln.runtime.quantization.gptq import gptq_quantize
from kiln.runtime.quantization.smoothquant import Int8LinearMethod, quantize_rows_int8

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_linear(method: str, N=256, K=512, G=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    lin = ReplicatedLinear(K, N)
    lin.weight.data.copy_(w)
    if method == "fp8":
        q, s = quantize_rows_fp8(w)
        from kiln.runtime.quantization.base import replace_weight

        replace_weight(lin, {"weight": q, "weight_scale": s.view(-1)})
        lin.quant_method = Fp8LinearMethod()
    elif method == "int8":
        q, s = quantize_rows_int8(w)
        from kiln.runtime.quantization.base import replace_weight

        replace_weight(lin, {"weight": q, "weight_scale": s.view(-1)})
        lin.quant_method = Int8LinearMethod()
    else:
        s, z = int4.quantize_params(w, G)
        int4.store_int4(lin, int4.quantize_with(w, s, z, G), s, z, G)
    return lin, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method,bound", [("fp8", 0.06), ("int8", 0.03), ("int4", 0.15)])
@pytest.mark.parametrize("M", [1, 7, 40])
def test_apply_close_to_float(device, method, bound, M):
    lin, w = make_linear(method)
    lin = lin.to(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(M, w.shape[1], generator=torch.Generator().manual_seed(1))
    ref = x @ w.t()
    y = lin(x.to(device, dtype))
    assert y.shape == (M, w.shape[0]) and y.dtype == dtype
    assert rel(y.cpu(), ref) < bound


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", ["fp8", "int8", "int4"])
def test_gpu_kernel_matches_cpu_path(method):
    lin, w = make_linear(method, N=512, K=1024)
    x = torch.randn(33, 1024, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y_cpu = lin(x.float())
    y_gpu = lin.to("cuda")(x.cuda())
    assert rel(y_gpu.cpu(), y_cpu) < 2e-2


def test_gptq_beats_round_to_nearest():
    """On correlated inputs GPTQ's output error is below plain rounding's (same format)."""
    g = torch.Generator().manual_seed(0)
    K, N, G = 128, 64, 32
    mix = torch.randn(K, K, generator=g) / K**0.5
    x = torch.randn(2048, K, generator=g) @ mix + torch.randn(2048, K, generator=g) * 0.1
    w = torch.randn(N, K, generator=g)
    H = 2 * x.double().t() @ x.double() / x.shape[0]
    q, s, z = gptq_quantize(w, H, G)
    wq = (q.float() - z.repeat_interleave(G, 1)) * s.repeat_interleave(G, 1)
    err_gptq = ((x @ w.t() - x @ wq.t()) ** 2).mean()
    err_rtn = ((x @ w.t() - x @ int4.fake_quantize(w, G).t()) ** 2).mean()
    assert err_gptq < 0.8 * err_rtn


def test_gptq_fp8_beats_round_to_nearest():
    """FP8 GPTQ (E4M3 grid, per-row scales): codes and scales are the serving format, every
    weight is on the scaled grid, and the output error is below plain per-row rounding's."""
    from kiln.runtime.quantization.fp8 import FP8, fp8_round, gptq_fp8, search_row_scales

    g = torch.Generator().manual_seed(0)
    K, N = 128, 64
    mix = torch.randn(K, K, generator=g) / K**0.5
    x = torch.randn(2048, K, generator=g) @ mix + torch.randn(2048, K, generator=g) * 0.1
    w = torch.randn(N, K, generator=g)
    H = 2 * x.double().t() @ x.double() / x.shape[0]
    q, s = gptq_fp8(w, H)
    assert q.dtype == FP8 and q.shape == (N, K) and s.shape == (N,) and bool((s > 0).all())
    wq = q.float() * s[:, None]
    q_rtn, s_rtn = quantize_rows_fp8(w)
    w_rtn = q_rtn.float() * s_rtn
    err = ((x @ w.t() - x @ wq.t()) ** 2).mean()
    err_rtn = ((x @ w.t() - x @ w_rtn.t()) ** 2).mean()
    assert err < 0.7 * err_rtn
    imp = torch.diag(H).float()  # the scale search is never worse than absmax (its first candidate)
    s2 = search_row_scales(w, imp)
    e2 = (((w - fp8_round(w, s2[:, None])) ** 2) * imp).sum()
    assert s2.shape == (N,) and e2 <= (((w - w_rtn) ** 2) * imp).sum() * (1 + 1e-6)


def test_awq_search_never_worse_than_rtn():
    from kiln.runtime.quantization.awq import search_scale

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    x[:, :4] *= 20  # salient channels
    w = torch.randn(32, 64, generator=g)
    s = search_scale(x, x.abs().mean(0), w, 32)
    err = ((x @ w.t() - (x / s) @ int4.fake_quantize(w * s, 32).t()) ** 2).mean()
    err_rtn = ((x @ w.t() - x @ int4.fake_quantize(w, 32).t()) ** 2).mean()
    assert err <= err_rtn


def test_smoothing_is_exact_before_rounding():
    from kiln.runtime.quantization.smoothquant import smoothing_factors

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=g)
    x[:, 3] *= 50
    w = torch.randn(8, 32, generator=g)
    s = smoothing_factors(x.abs().amax(0), w, 0.5)
    assert torch.allclose((x / s) @ (w * s).t(), x @ w.t(), rtol=1e-4, atol=1e-4)
    assert (x / s).abs().amax(0).max() < x.abs().amax(0).max()


def test_cpu_dequant_cache_follows_the_buffers():
    """The CPU path's cached dequantized weight is rebuilt when the layer's buffers are
    replaced (new tensors, possibly at the freed buffers' addresses) or written in place."""
    lin, _ = make_linear("int4", N=64, K=128, G=32)
    x = torch.randn(3, 128)
    first = lin(x)
    for seed in (1, 2, 3):  # re-quantize other weights into fresh buffers, old ones freed
        w = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed)) * 0.05
        s, z = int4.quantize_params(w, 32)
        int4.store_int4(lin, int4.quantize_with(w, s, z, 32), s, z, 32)
        ref = x @ int4.dequantize(lin.qweight, lin.scales, lin.qzeros).t()
        assert rel(lin(x), ref) < 1e-6
    with torch.no_grad():
        lin.scales.mul_(2)  # in place
    assert rel(lin(x), x @ int4.dequantize(lin.qweight, lin.scales, lin.qzeros).t()) < 1e-6
    assert not torch.allclose(lin(x), first)
