"""Chooses the attention implementation per device: Triton kernels from ``kiln.kernels`` on
CUDA, the torch gather + SDPA path on CPU."""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import torch_backend
from .metadata import AttentionMetadata


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        import kiln.kernels as k  # noqa: PLC0415
    except Exception:  # pragma: no cover
        return None
    return k if hasattr(k, "paged_attention") and hasattr(k, "reshape_and_cache") else None


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Store [T, Hkv, D] K/V rows at ``slot_mapping`` (int64 [T], -1 = skip)."""
    k = _kernels() if key.is_cuda else None
    if k is not None:
        k.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if k_scale is not None:  # clamp: casting past +-448 to float8_e4m3fn gives NaN
        key = (key.float() / k_scale).clamp(-448.0, 448.0)
        value = (value.float() / v_scale).clamp(-448.0, 448.0)
    torch_backend.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
                    use_kernels: bool | None = None):
    """Causal attention over the paged cache; see ``torch_backend.paged_attention``.

    ``use_kernels``: None picks the Triton kernels for CUDA tensors and the torch path
    otherwise; True forces the kernels (CPU tensors need ``TRITON_INTERPRET=1``).
    """
    k = _kernels() if (q.is_cuda if use_kernels is None else use_kernels) else None
    if k is not None:
        nd = meta.num_decodes
        if 0 < nd < meta.num_seqs and meta.prefill_query_start_loc is not None:
            # A mixed batch: decodes through the decode kernel (query heads of a KV head in
            # one program, split-K), prefill chunks through the prefill kernel, so decode
            # rows do not pad the prefill kernel's query blocks (vLLM splits batches alike).
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            k.paged_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                              meta.query_start_loc[: nd + 1], scale, k_scale, v_scale, out=out[:nd],
                              max_query_len=1, max_seq_len=meta.max_decode_seq_len or None)
            k.paged_attention(q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
                              meta.prefill_query_start_loc, scale, k_scale, v_scale, out=out[nd:],
                              max_query_len=meta.max_query_len,
                              max_seq_len=meta.max_seq_len if meta.max_seq_len > 0 else None)
            return out
        return k.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                 scale, k_scale, v_scale, max_query_len=meta.max_query_len,
                                 max_seq_len=meta.max_seq_len if meta.max_seq_len > 0 else None)
    if k_scale is not None:  # fp8 cache on CPU: dequantize only the blocks this batch reads
        k_cache, v_cache, meta = _dequantize_used_blocks(k_cache, v_cache, meta, q.dtype, k_scale, v_scale)
    return torch_backend.paged_attention(q, k_cache, v_cache, meta, scale)


def _dequantize_used_blocks(k_cache, v_cache, meta: AttentionMetadata, dtype: torch.dtype, k_scale, v_scale):
    """The blocks of an fp8 cache ``[num_blocks, block_size, Hkv, D]`` that the batch's block
    tables cover (``ceil(seq_len / block_size)`` per sequence), dequantized to ``dtype`` into a
    compact cache, and the metadata with block tables renumbered into it.  Work and memory
    scale with the batch's context, not with the pool (converting the whole pool every layer
    made an fp8-KV server on the CPU stall as soon as the pool was large)."""
    bs = k_cache.shape[1]
    dev = k_cache.device
    nblk = torch.tensor([(n + bs - 1) // bs for n in meta.seq_lens_list], device=dev)
    width = max(1, int(nblk.max()) if len(nblk) else 1)
    bt = meta.block_tables[:, :width].to(torch.int64)
    cover = torch.arange(bt.shape[1], device=dev).unsqueeze(0) < nblk.unsqueeze(1)
    used = torch.unique(bt[cover])
    if used.numel() == 0:
        used = torch.zeros(1, dtype=torch.int64, device=dev)
    remap = torch.zeros(k_cache.shape[0], dtype=torch.int64, device=dev)
    remap[used] = torch.arange(used.numel(), device=dev)
    tables = torch.where(cover, remap[bt.clamp(0, k_cache.shape[0] - 1)], 0).to(meta.block_tables.dtype)
    k = k_cache.index_select(0, used).to(dtype) * k_scale
    v = v_cache.index_select(0, used).to(dtype) * v_scale
    return k, v, dataclasses.replace(meta, block_tables=tables)
