"""SwiGLU fused with the per-token FP8 quantization of its output (the down projection's
input), against the torch reference; on the GPU also bit for bit against the two kernels it
replaces (``silu_and_mul`` then ``per_token_quant_fp8``)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.fp8_quant import silu_and_mul_quant_fp8, silu_and_mul_quant_fp8_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _gate_up(T: int, inter: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(T * 7 + inter)
    x = torch.randn(T, 2 * inter, generator=g) * 3
    x[0, 3] = 40.0  # a large gate: the row's scale follows it
    x[-1] = 0.0  # an all-zero row: the smallest scale, zeros out
    return x.to(dtype).to(DEVICE)


def _fp8_llama(num_layers: int):
    """A random bf16 Llama (hidden 512) on CUDA with FP8 weights rounded to nearest, and its config."""
    from kiln.runtime.model.config import ModelConfig
    from kiln.runtime.model.llama import LlamaForCausalLM
    from kiln.runtime.quantization.rtn import quantize_model_rtn

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 512,
        "intermediate_size": 1536, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0.0, 0.05)
    quantize_model_rtn(model, "fp8")
    return model, cfg


@pytest.mark.parametrize("T,inter", [(1, 256), (5, 576), (3, 1000)] + ([(768, 14336)] if HAS_CUDA else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_quant_fp8_against_the_reference(T, inter, dtype):
    x = _gate_up(T, inter, dtype)
    q, s = silu_and_mul_quant_fp8(x)
    qr, sr = silu_and_mul_quant_fp8_ref(x.cpu())
    assert q.shape == (T, inter) and q.dtype == torch.float8_e4m3fn and s.shape == (T, 1) and s.dtype == torch.float32
    # the activation is rounded to x's dtype before its max: scales agree to one ulp of it
    assert torch.allclose(s.cpu(), sr, rtol=1e-2, atol=0)
    assert float(s[-1]) == pytest.approx(1e-12 / 448) and not q[-1].float().any()
    if HAS_CUDA:  # the interpreter's float8 cast is not round-to-nearest (125.9 -> 64): scales only there
        assert rel_err(q.cpu().float() * s.cpu(), qr.float() * sr) < 0.02


@pytest.mark.skipif(not HAS_CUDA, reason="compares compiled kernels bit for bit; the interpreter's float8 cast "
                                         "rounds differently")
@pytest.mark.parametrize("T,inter", [(1, 14336), (7, 576), (512, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_equals_the_two_kernels(T, inter, dtype):
    from kiln.kernels.activation import silu_and_mul
    from kiln.kernels.fp8_quant import per_token_quant_fp8

    x = _gate_up(T, inter, dtype)
    q, s = silu_and_mul_quant_fp8(x)
    q2, s2 = per_token_quant_fp8(silu_and_mul(x))
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


@pytest.mark.parametrize("bad,message", [
    (lambda: torch.zeros(4, 6, dtype=torch.float32), "float16 or bfloat16"),
    (lambda: torch.zeros(4, 7, dtype=torch.bfloat16), "2 \\* I"),
    (lambda: torch.zeros(8, 4, dtype=torch.bfloat16).t(), "contiguous last dimension"),
    (lambda: torch.zeros(2, 2, 4, dtype=torch.bfloat16), "2-D"),
])
def test_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        silu_and_mul_quant_fp8(bad().to(DEVICE))


@pytest.mark.skipif(not HAS_CUDA, reason="the fused path runs on CUDA only (torch._scaled_mm)")
def test_fp8_mlp_takes_the_fused_path_with_the_same_output():
    """An FP8 Llama MLP (weights rounded to nearest) gives bit-identical output through the
    fused SwiGLU + quantization and through SiLU-and-mul then the down projection."""
    model, _ = _fp8_llama(num_layers=1)
    mlp = model.model.layers[0].mlp
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    gate_up = mlp.gate_up_proj(x)
    assert mlp.down_proj.quant_method.apply_after_swiglu(mlp.down_proj, gate_up) is not None
    assert torch.equal(mlp(x), mlp.down_proj(mlp.act_fn(gate_up)))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("T,H", [(1, 256), (9, 576)] + ([(768, 4096)] if HAS_CUDA else []))
def test_rms_norm_quant_fp8(T, H, residual):
    """The norm's outputs are the plain norm's; q and scales quantize the normalized row (on the
    GPU bit for bit as per_token_quant_fp8 of it)."""
    from kiln.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_quant_fp8
    from kiln.kernels.reference import per_token_quant_fp8_ref

    g = torch.Generator().manual_seed(T + H)
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    r = (torch.randn(T, H, generator=g)).to(torch.bfloat16).to(DEVICE) if residual else None
    w = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    x0 = x.clone()
    out, res_out, q, s = rms_norm_quant_fp8(x, w, 1e-6, r)
    assert torch.equal(x, x0)  # inputs untouched
    if residual:
        want, want_res = fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(res_out, want_res)
    else:
        want = rms_norm(x, w, 1e-6)
        assert res_out is None
    assert torch.equal(out, want)
    _, sr = per_token_quant_fp8_ref(want.cpu())
    assert torch.allclose(s.cpu(), sr, rtol=1e-6, atol=0)  # the GPU's float32 division may differ in the last bit
    if HAS_CUDA:
        from kiln.kernels.fp8_quant import per_token_quant_fp8

        q2, s2 = per_token_quant_fp8(want)
        assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


@pytest.mark.skipif(not HAS_CUDA, reason="the fused path runs on CUDA only (torch._scaled_mm)")
def test_fp8_decoder_layer_with_fused_norm_quantization_is_unchanged(monkeypatch):
    """A whole FP8 decoder stack: the norms quantizing for the QKV and gate|up projections give
    the same hidden states as the separate quantization kernels."""
    from kiln.runtime.attention import AttentionMetadata
    from kiln.runtime.quantization.fp8 import Fp8LinearMethod

    model, cfg = _fp8_llama(num_layers=2)
    T = 11
    for a in model.attention_layers():
        a.k_cache = torch.zeros(4, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
        a.v_cache = torch.zeros_like(a.k_cache)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T, device="cuda"), block_tables=torch.tensor([[0]], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([T], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32, device="cuda"), max_query_len=T, max_seq_len=T,
        seq_lens_list=[T], query_lens_list=[T], block_size=16)
    ids = torch.randint(0, 256, (T,), device="cuda")
    pos = torch.arange(T, device="cuda")
    fused = model(ids, pos, meta)
    calls = []
    orig = Fp8LinearMethod.apply

    def counting(self, layer, x):
        calls.append(layer.prequantized is not None)
        return orig(self, layer, x)

    monkeypatch.setattr(Fp8LinearMethod, "apply", counting)
    model(ids, pos, meta)
    assert calls.count(True) == 2 * cfg.num_hidden_layers  # QKV and gate|up of every layer
    monkeypatch.setattr(Fp8LinearMethod, "accepts_prequantized", False)
    assert torch.equal(model(ids, pos, meta), fused)


@pytest.mark.parametrize("bad,message", [
    (lambda: (torch.zeros(4, 64), torch.ones(64)), "float16/bfloat16"),
    (lambda: (torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)), "weight must be"),
    (lambda: (torch.zeros(64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)), r"\[num_tokens, hidden\]"),
])
def test_rms_norm_quant_fp8_bad_input(bad, message):
    from kiln.kernels.norm import rms_norm_quant_fp8

    x, w = bad()
    with pytest.raises(ValueError, match=message):
        rms_norm_quant_fp8(x.to(DEVICE), w.to(DEVICE), 1e-6)
