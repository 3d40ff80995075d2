"""Attention over the paged KV cache in plain torch (the CPU path).

K/V are gathered through the block table into a padded ``[S, Hkv, L, D]`` batch and
attended with one ``scaled_dot_product_attention`` call under a causal, length-aware mask
(gather + SDPA, as the runtime issue asks).  It serves every batch shape (prefill, chunked
prefill with a cached prefix, decode, mixed) and is the reference that Triton kernels are
compared against in the runtime's tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V rows into the paged pool.

    Args:
        key, value: [T, Hkv, D] (model dtype).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        slot_mapping: int64 [T]; negative slots (padding) are skipped.
    """
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if flat_k.dtype == torch.float8_e4m3fn:  # CPU index_copy_ lacks fp8: copy the bytes
        flat_k.view(torch.uint8).index_copy_(0, slot_mapping, key.to(flat_k.dtype).view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slot_mapping, value.to(flat_v.dtype).view(torch.uint8))
        return
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of the new tokens over each sequence's cached context.

    Args:
        q: [T, Hq, D] query rows of all sequences, flattened.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        meta: batch layout; query row j of sequence s sits at absolute position
            ``seq_lens[s] - q_len + j`` and sees keys at positions ``0..`` that position.
        scale: softmax scale (usually ``head_dim ** -0.5``).
    Returns:
        [T, Hq, D] in ``q.dtype``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    S = meta.num_seqs
    seq_lens = meta.seq_lens_list
    q_lens = meta.query_lens_list
    L = max(seq_lens)
    Q = max(q_lens)
    device = q.device

    # Slot index of every (sequence, key position) pair: [S, L].
    pos = torch.arange(L, device=device)
    nblk = (L + block_size - 1) // block_size
    bt = meta.block_tables[:, :nblk].to(torch.int64)
    slots = bt.repeat_interleave(block_size, dim=1)[:, :L] * block_size + (pos % block_size)
    seq_lens_t = torch.tensor(seq_lens, device=device)
    valid_k = pos.unsqueeze(0) < seq_lens_t.unsqueeze(1)  # [S, L]
    slots = torch.where(valid_k, slots, torch.zeros_like(slots))
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    k = flat_k.index_select(0, slots.reshape(-1)).view(S, L, num_kv_heads, head_dim).transpose(1, 2)
    v = flat_v.index_select(0, slots.reshape(-1)).view(S, L, num_kv_heads, head_dim).transpose(1, 2)
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    if S == 1:
        qb = q.view(1, num_tokens, num_heads, head_dim).transpose(1, 2)
    else:
        qb = q.new_zeros(S, Q, num_heads, head_dim)
        starts = meta.query_start_loc.tolist() if S > 1 else [0, num_tokens]
        if Q == 1:
            qb[:, 0] = q
        else:
            for s in range(S):
                qb[s, : q_lens[s]] = q[starts[s] : starts[s + 1]]
        qb = qb.transpose(1, 2)  # [S, Hq, Q, D]

    # Mask [S, 1, Q, L]: key position <= query position, and key inside the context.
    q_lens_t = torch.tensor(q_lens, device=device)
    q_pos = (seq_lens_t - q_lens_t).unsqueeze(1) + torch.arange(Q, device=device).unsqueeze(0)  # [S, Q]
    mask = (pos.view(1, 1, L) <= q_pos.unsqueeze(2)) & valid_k.unsqueeze(1)
    mask = mask.unsqueeze(1)

    if num_kv_heads != num_heads:
        rep = num_heads // num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)  # [S, Hq, Q, D]
    out = out.transpose(1, 2)  # [S, Q, Hq, D]
    if S == 1:
        return out.reshape(num_tokens, num_heads, head_dim)
    if Q == 1:
        return out[:, 0].contiguous()
    return torch.cat([out[s, : q_lens[s]] for s in range(S)], dim=0)
