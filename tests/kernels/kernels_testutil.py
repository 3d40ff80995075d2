"""Shared helpers for the kernel tests: tolerances, poisoning, paged-cache builders."""

from __future__ import annotations

import math

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")

# dtypes the kernels are tested in on this machine.  The CPU interpreter's tl.dot is wrong
# for bfloat16 (see DESIGN.md, Known pitfalls), so bf16 attention runs on the GPU only.
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATTN_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])

# ||out - ref|| / ||ref|| bounds (METHOD.md: fp32 far under 1e-3; bf16 between 1e-3 and 1e-2)
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# Triton 3.6's interpreter casts float32 -> bfloat16 by truncation (the GPU rounds to
# nearest even), so on the CPU a bf16 result may be one more bf16 step (2**-8 relative) off.
BF16_STEP = 2.0**-8
ELEMENTWISE_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=2 * BF16_STEP, atol=2 * BF16_STEP) if HAS_CUDA else dict(rtol=4 * BF16_STEP, atol=4 * BF16_STEP),
}
# "bit exact" for a single rounding: exact on the GPU, one bf16 step on the CPU interpreter
EXACT_TOL = {
    torch.float32: dict(rtol=0, atol=0),
    torch.float16: dict(rtol=0, atol=0),
    torch.bfloat16: dict(rtol=0, atol=0) if HAS_CUDA else dict(rtol=2 * BF16_STEP, atol=0),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, factor: float = 1.0) -> None:
    err = rel_err(out, ref)
    assert err <= REL_TOL[dtype] * factor, f"relative error {err:.3g} > {REL_TOL[dtype] * factor:.3g} ({dtype})"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (float) so any element the kernel fails to write shows up."""
    return t.fill_(float("nan"))


def make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, extra_blocks=7, device=DEVICE,
                  num_blocks=None, high_ids=False):
    """Random K/V caches and a block table with shuffled (non-contiguous) block ids.

    Returns ``(k_cache, v_cache, block_tables int32 [S, max_blocks])``.  Unused table entries
    hold a huge id so that reading past the context would fault or show.  With
    ``high_ids`` the blocks are taken from the top of a pool of ``num_blocks`` blocks that
    is allocated but left untouched except for the used blocks (int64 offset tests).
    """
    S = len(seq_lens)
    need = [math.ceil(l / block_size) for l in seq_lens]
    max_blocks = max(max(need), 1) + 1
    total = sum(need)
    store_dtype = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    if num_blocks is None:
        num_blocks = total + extra_blocks
    if high_ids:
        ids = torch.arange(num_blocks - total, num_blocks)[torch.randperm(total)]
        k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        v_cache = torch.empty_like(k_cache)
        for cache in (k_cache, v_cache):
            vals = torch.randn(total, block_size, num_kv_heads, head_dim, device=device, dtype=torch.float32)
            cache[ids.to(device)] = vals.to(dtype)
    else:
        ids = torch.randperm(num_blocks)[:total]
        k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
        v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    table = torch.full((S, max_blocks), 2**31 - 1, dtype=torch.int32)
    pos = 0
    for s, n in enumerate(need):
        table[s, :n] = ids[pos:pos + n].to(torch.int32)
        pos += n
    return k_cache, v_cache, table.to(device)


def make_queries(q_lens, num_heads, head_dim, dtype, device=DEVICE):
    T = sum(q_lens)
    q = torch.randn(T, num_heads, head_dim, device=device, dtype=torch.float32).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return q, cu.to(device)
