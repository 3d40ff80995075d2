"""Torch reference of the batched LoRA ops (and the CPU runtime's path).

Shapes: ``T`` tokens, ``K`` input features, ``N`` output features, ``R`` the buffers' rank,
``S`` device slots.  ``token_slots`` int32 [T] holds each token's slot, -1 for none.
"""

from __future__ import annotations

import torch


def lora_segments(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group a step's tokens by slot, on the device and without a host sync.

    Args:
        token_slots: int32 [T], values in ``[-1, num_slots)``.
        num_slots: ``S``.
    Returns:
        ``sorted_token_ids`` int32 [T] (token indices ordered by slot, stable; tokens without
        an adapter last), ``counts`` int32 [S] (tokens per slot) and ``starts`` int32 [S]
        (each slot's first index into ``sorted_token_ids``).
    """
    key = token_slots.to(torch.int64)
    key = torch.where(key < 0, torch.full_like(key, num_slots), key)
    sorted_ids = torch.sort(key, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    return sorted_ids, counts[:num_slots].to(torch.int32), starts[:num_slots].to(torch.int32)


def _slot_rows(token_slots: torch.Tensor):
    """``(slot, row indices)`` for each slot present (host sync: the CPU path)."""
    slots = token_slots.to(torch.int64)
    for s in torch.unique(slots).tolist():
        if s >= 0:
            yield s, (slots == s).nonzero(as_tuple=True)[0]


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = x[t] @ lora_a[slot(t)].T`` in float32; rows of tokens without an adapter
    are zero.

    Args:
        x: [T, K] float16/bfloat16/float32.
        lora_a: [S, R, K], x's dtype.
        token_slots: int32 [T].
        out: optional float32 [T, R] destination.
    Returns:
        float32 [T, R].
    """
    T, R = x.shape[0], lora_a.shape[1]
    if out is None:
        out = torch.empty(T, R, dtype=torch.float32, device=x.device)
    out.zero_()
    for s, rows in _slot_rows(token_slots):
        out[rows] = (x[rows].float() @ lora_a[s].float().T)
    return out


def lora_expand_ref(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                    offset: int = 0, part_sizes: list[int] | None = None) -> torch.Tensor:
    """``y[t, offset + c_p : offset + c_p + N_p] += h[t, p*R:(p+1)*R] @ lora_b[slot(t), c_p:c_p + N_p].T``
    for each part ``p`` in place (float32 accumulation, stored in y's dtype); tokens without
    an adapter are left alone.

    Args:
        y: [T, >= offset + N] (the base layer's output).
        h: float32 [T, P*R] (``lora_shrink``'s output; a column slice is fine).
        lora_b: [S, N, R], y's dtype, the scaling folded in; the parts stacked along N.
        token_slots: int32 [T].
        offset: first output column.
        part_sizes: the parts' widths (sum N); None: one part.
    Returns:
        ``y``.
    """
    N, R = lora_b.shape[1], lora_b.shape[2]
    parts = [N] if part_sizes is None else list(part_sizes)
    for s, rows in _slot_rows(token_slots):
        c = 0
        for p, n in enumerate(parts):
            hs = h[rows, p * R:(p + 1) * R]
            hs = hs.to(lora_b.dtype) if lora_b.dtype != torch.float32 else hs
            delta = hs.float() @ lora_b[s, c:c + n].float().T
            cols = slice(offset + c, offset + c + n)
            y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)
            c += n
    return y
