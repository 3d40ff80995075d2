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


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one sequence, [Hkv, length, D], read through its block table."""
    bs = cache.shape[1]
    nblk = (length + bs - 1) // bs
    rows = cache.index_select(0, block_table[:nblk].to(torch.int64))  # [nblk, bs, Hkv, D]
    return rows.reshape(nblk * bs, *cache.shape[2:])[:length].transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of the new tokens over each sequence's cached context.

    Decode rows (one query token) are batched: K/V of every decoding sequence are gathered
    into a padded ``[S, Hkv, L, D]`` batch and the query heads that share a KV head are
    stacked on the query axis (``[S, Hkv, group, D]``), so grouped-query attention needs no
    copy of K/V.  Prefill chunks run per sequence with a causal mask offset by the cached
    prefix (no padding across sequences).

    Args:
        q: [T, Hq, D] query rows of all sequences, flattened.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        meta: batch layout; query row j of sequence s sits at absolute position
            ``seq_lens[s] - q_len + j`` and sees keys at positions ``0..`` that position.
        scale: softmax scale (usually ``head_dim ** -0.5``).
    Returns:
        [T, Hq, D] in ``q.dtype``.
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty_like(q)
    seq_lens = meta.seq_lens_list
    q_lens = meta.query_lens_list
    starts = meta.query_start_loc.tolist() if meta.num_seqs > 1 else [0, T]
    bt = meta.block_tables
    dec = [s for s in range(meta.num_seqs) if q_lens[s] == 1]
    if dec:
        L = max(seq_lens[s] for s in dec)
        bs = k_cache.shape[1]
        nblk = (L + bs - 1) // bs
        idx = torch.tensor(dec, device=q.device)
        tables = bt.index_select(0, idx)[:, :nblk].to(torch.int64)  # [S, nblk]
        k = k_cache.index_select(0, tables.reshape(-1)).view(len(dec), nblk * bs, Hkv, D)[:, :L]
        v = v_cache.index_select(0, tables.reshape(-1)).view(len(dec), nblk * bs, Hkv, D)[:, :L]
        k = k.transpose(1, 2).to(q.dtype)  # [S, Hkv, L, D]
        v = v.transpose(1, 2).to(q.dtype)
        lens = torch.tensor([seq_lens[s] for s in dec], device=q.device)
        mask = (torch.arange(L, device=q.device).unsqueeze(0) < lens.unsqueeze(1)).view(len(dec), 1, 1, L)
        rows = torch.tensor([starts[s] for s in dec], device=q.device)
        qd = q.index_select(0, rows).view(len(dec), Hkv, group, D)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)  # [S, Hkv, group, D]
        out.index_copy_(0, rows, o.reshape(len(dec), Hq, D))
    for s in range(meta.num_seqs):
        n = q_lens[s]
        if n == 1:
            continue
        L = seq_lens[s]
        k = _gather(k_cache, bt[s], L).to(q.dtype)  # [Hkv, L, D]
        v = _gather(v_cache, bt[s], L).to(q.dtype)
        qs = q[starts[s] : starts[s] + n]  # [n, Hq, D]
        # Stack the query heads of each KV head on the query axis: [Hkv, group*n, D].
        qg = qs.view(n, Hkv, group, D).permute(1, 2, 0, 3).reshape(Hkv, group * n, D)
        qpos = torch.arange(L - n, L, device=q.device)
        mask = (torch.arange(L, device=q.device).unsqueeze(0) <= qpos.unsqueeze(1))  # [n, L]
        mask = mask.repeat(group, 1).unsqueeze(0)  # [1, group*n, L]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [Hkv, group*n, D]
        out[starts[s] : starts[s] + n] = o.view(Hkv, group, n, D).permute(2, 0, 1, 3).reshape(n, Hq, D)
    return out
