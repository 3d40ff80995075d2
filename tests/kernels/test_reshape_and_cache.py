"""reshape_and_cache (Triton) against reshape_and_cache_ref: exact equality of the caches."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, FLOAT_DTYPES, HAS_CUDA
from kiln.kernels import reshape_and_cache, reshape_and_cache_ref


def _caches(num_blocks, block_size, H, D, dtype):
    # filled with a sentinel so that stray writes show up
    k = torch.full((num_blocks, block_size, H, D), 3.0, device=DEVICE).to(dtype)
    return k, k.clone()


def _slots(T, num_blocks, block_size, num_padding=2):
    slots = torch.randperm(num_blocks * block_size)[:T]
    slots[torch.randperm(T)[:num_padding]] = -1
    return slots.to(DEVICE)


def _check(key, value, k_cache, v_cache, slots, k_scale=None, v_scale=None):
    k2, v2 = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    reshape_and_cache_ref(key, value, k2, v2, slots, k_scale, v_scale)
    # compare bit patterns (fp8 and NaN safe)
    assert torch.equal(k_cache.view(torch.uint8), k2.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v2.view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("H,D", [(1, 16), (2, 40), (8, 32)])
def test_writes_match_reference(H, D, block_size, dtype):
    T, nb = 13, 5
    k_cache, v_cache = _caches(nb, block_size, H, D, dtype)
    key = torch.randn(T, H, D, device=DEVICE).to(dtype)
    value = torch.randn(T, H, D, device=DEVICE).to(dtype)
    _check(key, value, k_cache, v_cache, _slots(T, nb, block_size))


def test_strided_key_value_views():
    """key/value as views of a fused QKV output and a cache view with a padded block stride."""
    T, Hq, H, D, bs = 9, 4, 2, 16, 16
    qkv = torch.randn(T, (Hq + 2 * H) * D, device=DEVICE)
    key = qkv[:, Hq * D:(Hq + H) * D].view(T, H, D)
    value = qkv[:, (Hq + H) * D:].view(T, H, D)
    pool = torch.zeros(6, bs + 3, H, D, device=DEVICE)
    k_cache, v_cache = pool[:, :bs], pool.clone()[:, :bs]
    _check(key, value, k_cache, v_cache, _slots(T, 6, bs))


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "per_head"])
def test_fp8_cache(scale_kind):
    T, H, D, bs, nb = 11, 2, 32, 16, 4
    k_cache, v_cache = _caches(nb, bs, H, D, torch.float8_e4m3fn)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    key = (torch.randn(T, H, D, device=DEVICE) * 3).to(dtype)
    value = (torch.randn(T, H, D, device=DEVICE) * 0.01).to(dtype)  # exercises fp8 subnormals
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 1.9868, 7.9])  # clamping and round-up carries
    scales = {
        "none": (None, None),
        "float": (0.5, 0.003),
        "tensor": (torch.tensor([0.5], device=DEVICE), torch.tensor([0.003], device=DEVICE)),
        "per_head": (torch.tensor([0.5, 0.25], device=DEVICE), torch.tensor([0.003, 0.01], device=DEVICE)),
    }[scale_kind]
    _check(key, value, k_cache, v_cache, _slots(T, nb, bs), *scales)


def test_large_block_ids_need_int64_offsets():
    H, D, bs = 1, 16, 16
    nb = 2**31 // (bs * H * D) + 8  # lazily committed: only the written pages are touched
    k_cache = torch.empty(nb, bs, H, D, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    blocks = torch.tensor([nb - 1, nb - 5, 3])
    slots = (blocks * bs + torch.tensor([15, 0, 7])).to(DEVICE)
    key = torch.randn(3, H, D, device=DEVICE, dtype=torch.float16)
    value = torch.randn(3, H, D, device=DEVICE, dtype=torch.float16)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, H, D)[slots], key)
    assert torch.equal(v_cache.view(-1, H, D)[slots], value)


def test_rejects_bad_arguments():
    k_cache, v_cache = _caches(2, 16, 2, 16, torch.float32)
    key = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError):
        reshape_and_cache(key[:, :1], key[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError):
        reshape_and_cache(key, key, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError):
        reshape_and_cache(key, key, k_cache, v_cache.half(), slots)
    f8 = k_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        reshape_and_cache(key, key, f8, f8.clone(), slots, torch.ones(3, device=DEVICE), None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_real_size(dtype):
    T, H, D, bs, nb = 8192, 8, 128, 16, 4096
    k_cache, v_cache = _caches(nb, bs, H, D, dtype)
    key = torch.randn(T, H, D, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn(T, H, D, device=DEVICE, dtype=torch.bfloat16)
    scale = torch.rand(H, device=DEVICE) + 0.01 if dtype == torch.float8_e4m3fn else None
    _check(key, value, k_cache, v_cache, _slots(T, nb, bs, num_padding=100), scale, scale)
