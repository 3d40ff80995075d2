"""rotary_embedding (Triton, in place) against rotary_embedding_ref."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, ELEMENTWISE_TOL, EXACT_TOL, FLOAT_DTYPES
from kiln.kernels import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref

TOL = ELEMENTWISE_TOL
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 16), (8, 2, 64), (8, 1, 40), (3, 1, 6)])
def test_rotary(Hq, Hkv, D, dtype):
    T = 7
    cache = build_cos_sin_cache(D, 20000, 500000.0, LLAMA3).to(DEVICE)
    pos = torch.tensor([0, 1, 5, 8191, 8192, 19999, 3], device=DEVICE)
    q = torch.randn(T, Hq, D, device=DEVICE).to(dtype)
    k = torch.randn(T, Hkv, D, device=DEVICE).to(dtype)
    rq, rk = rotary_embedding_ref(pos, q, k, cache)
    q2, k2 = q.clone(), k.clone()
    oq, ok = rotary_embedding(pos, q2, k2, cache)
    assert oq.data_ptr() == q2.data_ptr() and ok.data_ptr() == k2.data_ptr()
    torch.testing.assert_close(oq, rq, **TOL[dtype])
    torch.testing.assert_close(ok, rk, **TOL[dtype])


def test_rotary_on_fused_qkv_view():
    T, Hq, Hkv, D = 5, 4, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=DEVICE)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v_before = qkv[:, (Hq + Hkv) * D:].clone()
    cache = build_cos_sin_cache(D, 64, 10000.0).to(DEVICE)
    pos = torch.randint(0, 64, (T,), device=DEVICE)
    rq, rk = rotary_embedding_ref(pos, q, k, cache)
    rotary_embedding(pos, q, k, cache)
    torch.testing.assert_close(q, rq, **TOL[torch.float32])
    torch.testing.assert_close(k, rk, **TOL[torch.float32])
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], v_before)


def test_rejects_bad_arguments():
    q = torch.randn(3, 2, 8, device=DEVICE)
    cache = build_cos_sin_cache(8, 16, 10000.0).to(DEVICE)
    pos = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError):
        rotary_embedding(pos, q, q[:, :, :4], cache)
    with pytest.raises(ValueError):
        rotary_embedding(pos.float(), q, q, cache)
    with pytest.raises(ValueError):
        rotary_embedding(pos, q, q, cache[:, :4])


@pytest.mark.gpu
def test_gpu_real_size():
    T = 8192
    cache = build_cos_sin_cache(128, 131072, 500000.0, LLAMA3).to(DEVICE)
    pos = torch.randint(0, 131072, (T,), device=DEVICE)
    q = torch.randn(T, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(T, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    rq, rk = rotary_embedding_ref(pos, q, k, cache)
    rotary_embedding(pos, q, k, cache)
    torch.testing.assert_close(q, rq, **TOL[torch.bfloat16])
    torch.testing.assert_close(k, rk, **TOL[torch.bfloat16])
