"""Batched LoRA shrink/expand (Triton) against the torch reference, over mixed slots."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, HAS_CUDA
from kiln.kernels.lora import lora_expand, lora_expand_ref, lora_segments, lora_shrink, lora_shrink_ref

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def test_segments_group_tokens_by_slot():
    slots = torch.tensor([2, -1, 0, 2, 0, -1, 1], dtype=torch.int32, device=DEVICE)
    ids, counts, starts = lora_segments(slots, 4)
    assert counts.tolist() == [2, 1, 2, 0]
    assert starts.tolist() == [0, 2, 3, 5]
    assert ids.tolist()[:5] == [2, 4, 6, 0, 3]  # stable within a slot; no-adapter tokens last
    assert sorted(ids.tolist()[5:]) == [1, 5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,N,R,S", [(1, 64, 48, 8, 2), (37, 96, 80, 16, 3), (70, 40, 130, 64, 4)])
def test_shrink_expand_match_reference(T, K, N, R, S, dtype):
    x = torch.randn(T, K, device=DEVICE).to(dtype)
    a = (torch.randn(S, R, K, device=DEVICE) / K**0.5).to(dtype)
    b = (torch.randn(S, N, R, device=DEVICE) / R**0.5).to(dtype)
    slots = torch.randint(-1, S, (T,), dtype=torch.int32, device=DEVICE)
    slots[0] = S - 1  # at least one token with an adapter
    ids, counts, starts = lora_segments(slots, S)
    h = lora_shrink(x, a, ids, counts, starts)
    h_ref = lora_shrink_ref(x, a, slots)
    torch.testing.assert_close(h, h_ref, **TOL[dtype])
    base = torch.randn(T, N + 24, device=DEVICE).to(dtype)
    y = lora_expand(base.clone(), h_ref, b, ids, counts, starts, offset=24)
    y_ref = lora_expand_ref(base.clone(), h_ref, b, slots, offset=24)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    none = slots < 0
    assert torch.equal(y[none], base[none]), "a token without an adapter was changed"
    assert torch.equal(y[:, :24], base[:, :24]), "columns before the offset were changed"


@pytest.mark.parametrize("sizes", [[32, 16, 16], [40, 72], [24]])
def test_fused_parts_expand_in_one_launch(sizes):
    """A fused QKV (or gate|up) shrink ([T, P*R]) expanded for every part at once: part p
    takes h's columns p*R:(p+1)*R and B's rows of that part, into its columns of y."""
    T, K, R, S = 9, 200, 8, 2  # K over several splits of the shrink
    P = len(sizes)
    x = torch.randn(T, K, device=DEVICE)
    a = torch.randn(S, P * R, K, device=DEVICE)
    b = torch.randn(S, sum(sizes), R, device=DEVICE)
    slots = torch.tensor([0, 1, -1, 1, 0, 0, -1, 1, 1], dtype=torch.int32, device=DEVICE)
    ids, counts, starts = lora_segments(slots, S)
    h = lora_shrink(x, a, ids, counts, starts)
    torch.testing.assert_close(h, lora_shrink_ref(x, a, slots), rtol=1e-4, atol=1e-4)
    base = torch.randn(T, 5 + sum(sizes), device=DEVICE)
    y = lora_expand(base.clone(), h, b, ids, counts, starts, offset=5, part_sizes=sizes)
    y_ref = base.clone()
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        c = 0
        for p, n in enumerate(sizes):
            y_ref[t, 5 + c:5 + c + n] += x[t] @ a[s, p * R:(p + 1) * R].T @ b[s, c:c + n].T
            c += n
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lora_expand_ref(base.clone(), h, b, slots, offset=5, part_sizes=sizes), y_ref,
                               rtol=1e-4, atol=1e-4)


def test_rejects_bad_arguments():
    x = torch.randn(4, 16, device=DEVICE)
    a = torch.randn(2, 8, 32, device=DEVICE)
    ids, counts, starts = lora_segments(torch.zeros(4, dtype=torch.int32, device=DEVICE), 2)
    with pytest.raises(ValueError, match="input features"):
        lora_shrink(x, a, ids, counts, starts)
    with pytest.raises(ValueError, match="outside"):
        lora_expand(torch.zeros(4, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE),
                    torch.zeros(2, 16, 8, device=DEVICE), ids, counts, starts)
    with pytest.raises(ValueError, match="part sizes"):
        lora_expand(torch.zeros(4, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE),
                    torch.zeros(2, 16, 8, device=DEVICE), ids, counts, starts, part_sizes=[8, 4])
