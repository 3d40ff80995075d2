"""The torch references themselves, against Hugging Face's modules and naive formulas."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.kernels import reference as R

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING, {"rope_type": "linear", "factor": 4.0}])
def test_cos_sin_cache_matches_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        max_position_embeddings=131072, rope_scaling=scaling,
    )
    rot = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 7, 1000, 8191, 8192, 20000, 131071]])
    x = torch.randn(1, pos.shape[1], 128)
    cos, sin = rot(x, pos)
    table = R.build_cos_sin_cache(128, 131072, 500000.0, scaling)
    assert torch.equal(table[pos[0], :64], cos[0, :, :64])
    assert torch.equal(table[pos[0], 64:], sin[0, :, :64])
    q = torch.randn(pos.shape[1], 4, 128)
    k = torch.randn(pos.shape[1], 2, 128)
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    qo, ko = R.rotary_embedding_ref(pos[0], q, k, table)
    torch.testing.assert_close(qo, qh[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ko, kh[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_cos_sin_cache_rejects_unknown_scaling():
    with pytest.raises(ValueError):
        R.build_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError):
        R.build_cos_sin_cache(63, 16, 10000.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mod = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(96))
    x = torch.randn(5, 96).to(dtype)
    assert torch.equal(R.rms_norm_ref(x, mod.weight.detach(), 1e-5), mod(x).detach())
    r = torch.randn(5, 96).to(dtype)
    normed, res = R.fused_add_rms_norm_ref(x, r, mod.weight.detach(), 1e-5)
    assert torch.equal(res, x + r)
    assert torch.equal(normed, mod(x + r).detach())


def test_silu_and_mul_ref():
    x = torch.randn(3, 10, dtype=torch.float64)
    torch.testing.assert_close(R.silu_and_mul_ref(x), x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:])


def test_paged_attention_ref_matches_dense_causal_attention():
    """Scatter a contiguous K/V into shuffled blocks; compare with SDPA on the dense tensors."""
    torch.manual_seed(1)
    Hq, Hkv, D, bs = 8, 2, 16, 4
    seq_lens, q_lens = [9, 5, 13], [9, 1, 4]
    num_blocks = 20
    k_cache = torch.zeros(num_blocks, bs, Hkv, D, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks)
    tables, qs, outs, p = [], [], [], 0
    for L, ql in zip(seq_lens, q_lens):
        nb = math.ceil(L / bs)
        ids = perm[p:p + nb]
        p += nb
        tables.append(torch.cat([ids, torch.zeros(4 - nb, dtype=ids.dtype)]))
        k = torch.randn(L, Hkv, D, dtype=torch.float64)
        v = torch.randn(L, Hkv, D, dtype=torch.float64)
        slots = (ids[torch.arange(L) // bs] * bs + torch.arange(L) % bs)
        R.reshape_and_cache_ref(k, v, k_cache, v_cache, slots)
        q = torch.randn(ql, Hq, D, dtype=torch.float64)
        qs.append(q)
        # dense: queries are the last ql positions
        kk = k.repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        vv = v.repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        mask = torch.arange(L)[None, :] <= torch.arange(L - ql, L)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=0.3)
        outs.append(o.transpose(0, 1))
    cu = torch.tensor([0, 9, 10, 14], dtype=torch.int32)
    out = R.paged_attention_ref(torch.cat(qs), k_cache, v_cache, torch.stack(tables).to(torch.int32),
                                torch.tensor(seq_lens, dtype=torch.int32), cu, 0.3)
    torch.testing.assert_close(out, torch.cat(outs))


def test_fp8_reference_roundtrip_per_head_scale():
    key = torch.randn(6, 2, 8) * torch.tensor([1.0, 100.0])[None, :, None]
    cache = torch.zeros(2, 4, 2, 8, dtype=torch.float8_e4m3fn)
    scale = torch.tensor([1.0 / 64, 1.0])  # maps each head into fp8 range (max 448)
    R.reshape_and_cache_ref(key, key, cache, cache, torch.arange(6), scale, scale)
    back = cache.reshape(8, 2, 8)[:6].float() * scale[None, :, None]
    assert (back - key).abs().max() / key.abs().max() < 0.07
