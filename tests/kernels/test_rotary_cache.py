"""rotary_and_cache (Triton, rotary embedding fused with the KV-cache write) against
rotary_embedding_ref followed by reshape_and_cache_ref: q and k within the rotary kernel's
tolerance, the caches bit-equal to the reference write of the rotated keys and the values."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, ELEMENTWISE_TOL, FLOAT_DTYPES, HAS_CUDA
from kiln.kernels import build_cos_sin_cache, reshape_and_cache_ref, rotary_embedding_ref
from kiln.kernels.cache import rotary_and_cache


def _case(T, Hq, H, D, nb, bs, dtype, cache_dtype=None, pad=2, max_pos=4096, big_blocks=False):
    qkv = torch.randn(T, (Hq + 2 * H) * D, device=DEVICE).mul(2).to(dtype)  # q, k, v as views of a fused output
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + H) * D].view(T, H, D)
    v = qkv[:, (Hq + H) * D:].view(T, H, D)
    cs = build_cos_sin_cache(D, max_pos, 500000.0).to(DEVICE)
    pos = torch.randint(0, max_pos, (T,), device=DEVICE)
    slots = torch.randperm(nb * bs)[:T]
    if big_blocks:  # block ids past 2**31 / (bs * H * D) elements: int64 offsets
        slots = (nb - 1 - torch.arange(T)) * bs + torch.arange(T) % bs
    slots[torch.randperm(T)[:pad]] = -1
    cache = torch.full((nb, bs, H, D), 3.0, device=DEVICE).to(cache_dtype or dtype)
    return qkv, q, k, v, cs, pos, slots.to(DEVICE), cache, cache.clone()


def _check(q, k, v, cs, pos, k_cache, v_cache, slots, k_scale=None, v_scale=None):
    q_ref, k_ref = rotary_embedding_ref(pos, q.clone(), k.clone(), cs)
    kc, vc = k_cache.clone(), v_cache.clone()
    q_out, k_out = rotary_and_cache(pos, q, k, v, cs, k_cache, v_cache, slots, k_scale, v_scale)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q, q_ref, **ELEMENTWISE_TOL[q.dtype])
    torch.testing.assert_close(k, k_ref, **ELEMENTWISE_TOL[k.dtype])
    reshape_and_cache_ref(k, v, kc, vc, slots, k_scale, v_scale)  # the cache holds the rotated keys
    assert torch.equal(k_cache.view(torch.uint8), kc.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), vc.view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("Hq,H,D", [(4, 4, 16), (8, 2, 40), (8, 1, 32), (6, 3, 6)])
def test_matches_reference(Hq, H, D, bs, dtype):
    _, q, k, v, cs, pos, slots, kc, vc = _case(13, Hq, H, D, 5, bs, dtype)
    _check(q, k, v, cs, pos, kc, vc, slots)


@pytest.mark.parametrize("scale_kind", ["none", "float", "per_head"])
def test_fp8_cache(scale_kind):
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    _, q, k, v, cs, pos, slots, kc, vc = _case(11, 8, 2, 32, 4, 16, dtype, torch.float8_e4m3fn)
    scales = {"none": (None, None), "float": (0.5, 2.0),
              "per_head": (torch.tensor([0.25, 1.5], device=DEVICE), torch.tensor([2.0, 0.75], device=DEVICE))}
    _check(q, k, v, cs, pos, kc, vc, slots, *scales[scale_kind])


def test_large_block_ids_and_all_padding():
    _, q, k, v, cs, pos, slots, kc, vc = _case(7, 4, 2, 16, 9000, 16, torch.float32, big_blocks=True)
    _check(q, k, v, cs, pos, kc, vc, slots)  # offsets > 2**31 elements would need int64 (the pool is 2.3M here)
    _, q, k, v, cs, pos, slots, kc, vc = _case(3, 4, 2, 16, 2, 16, torch.float32, pad=3)
    _check(q, k, v, cs, pos, kc, vc, slots)  # nothing written, q and k still rotated


def test_bad_inputs():
    _, q, k, v, cs, pos, slots, kc, vc = _case(4, 4, 2, 16, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="k, v must be"):
        rotary_and_cache(pos, q, k, v[:, :1], cs, kc, vc, slots)
    with pytest.raises(ValueError, match="dtype"):
        rotary_and_cache(pos, q, k, v.half(), cs, kc, vc, slots)
    with pytest.raises(ValueError, match="cache"):
        rotary_and_cache(pos, q, k, v, cs, kc[:, :, :1], vc[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_and_cache(pos, q, k, v, cs, kc, vc, slots[:2])
