"""The int4 MLP's SwiGLU fused into the gate|up GEMV (``Int4LinearMethod.apply_silu_and_mul``,
``w4a16_gemm(..., silu_and_mul=True)``), wired through ``LlamaMLP``."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.model.config import ModelConfig
from kiln.runtime.model.llama import LlamaMLP
from kiln.runtime.quantization import int4


def _mlp(device: str, hidden: int = 256, inter: int = 384) -> LlamaMLP:
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    mlp = LlamaMLP(cfg)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        w = torch.randn_like(lin.weight) * 0.05
        s, z = int4.quantize_params(w, 128)
        int4.store_int4(lin, int4.quantize_with(w, s, z, 128), s, z, 128)
    return mlp.to(device)


def _reference(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    def w(lin):
        return int4.dequantize(lin.qweight, lin.scales, lin.qzeros, torch.float32)

    gate, up = (x.float() @ w(mlp.gate_up_proj).t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w(mlp.down_proj).t()


def test_cpu_mlp_runs_unfused():
    """Off CUDA the method declines (None) and the MLP runs the layer, then the activation."""
    mlp = _mlp("cpu")
    x = torch.randn(3, 256)
    assert mlp.gate_up_proj.quant_method.apply_silu_and_mul(mlp.gate_up_proj, x) is None
    ref = _reference(mlp, x)
    assert (mlp(x) - ref).norm() / ref.norm() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 2, 7])
def test_cuda_mlp_fuses_swiglu(monkeypatch, T):
    """On CUDA at decode sizes the MLP launches no SiLU-and-mul kernel (fused into the GEMV) and
    matches the float reference; larger batches take the unfused path, also correct."""
    import kiln.kernels as kk
    import kiln.kernels.activation as act

    mlp = _mlp("cuda").to(torch.bfloat16)
    x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    calls = []
    orig = act.silu_and_mul
    for mod in (act, kk):  # the GEMM's fallback and the MLP's own activation (ops -> kiln.kernels)
        monkeypatch.setattr(mod, "silu_and_mul", lambda *a, **k: calls.append(1) or orig(*a, **k))
    y = mlp(x)
    ref = _reference(mlp, x)
    assert (y.float() - ref).norm() / ref.norm() < 2e-2
    if T <= 2:
        assert not calls, "the SiLU-and-mul kernel ran although the GEMV fuses it"
