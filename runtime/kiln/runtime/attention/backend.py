"""Chooses the attention implementation per device: Triton kernels from ``kiln.kernels`` on
CUDA (launched with the engine's ``KernelOptions``), the torch references of
``kiln.kernels.reference`` on the CPU (plus a compact dequantized view of an fp8 cache)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util

import torch

from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.reference import paged_attention_ref, reshape_and_cache_ref

from .metadata import AttentionMetadata


@functools.lru_cache(maxsize=1)
def _kernels():
    """``(attention, cache)`` kernel modules of ``kiln.kernels``, or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("kiln.kernels.attention"), importlib.import_module("kiln.kernels.cache")


def rotary_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=None,
                        v_scale=None, options: KernelOptions = DEFAULT_OPTIONS) -> bool:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by their positions (int64 [T]) and store
    k, v at ``slot_mapping`` (int64 [T], -1 = skip) in one launch, where the fused kernel
    applies (CUDA with ``options.fused_rope_kv``); returns False (nothing done) otherwise, and
    the caller runs the rotary embedding and ``write_kv_cache`` separately."""
    kern = _kernels() if q.is_cuda and options.fused_rope_kv else None
    if kern is None:
        return False
    kern[1].rotary_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                             options=options)
    return True


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
                   options: KernelOptions = DEFAULT_OPTIONS) -> None:
    """Store [T, Hkv, D] K/V rows at ``slot_mapping`` (int64 [T], -1 = skip) into the caches
    ``[num_blocks, block_size, Hkv, D]`` (fp8 caches: divided by the scales, saturated)."""
    kern = _kernels() if key.is_cuda else None
    if kern is not None:
        kern[1].reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, options=options)
        return
    reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
                    use_kernels: bool | None = None, options: KernelOptions = DEFAULT_OPTIONS):
    """Causal attention of ``q`` [T, Hq, D] over the paged caches ``[num_blocks, block_size,
    Hkv, D]`` for the batch ``meta`` -> [T, Hq, D] in q's dtype
    (``kiln.kernels.reference.paged_attention_ref`` semantics).

    ``use_kernels``: None picks the Triton kernels for CUDA tensors and the torch reference
    otherwise; True forces the kernels (CPU tensors need ``TRITON_INTERPRET=1``).
    """
    kern = _kernels() if (q.is_cuda if use_kernels is None else use_kernels) else None
    if kern is not None:
        attn = kern[0].paged_attention
        nd = meta.num_decodes
        if 0 < nd < meta.num_seqs and meta.prefill_query_start_loc is not None:
            # A mixed batch: decodes through the decode kernel (query heads of a KV head in
            # one program, split-K), prefill chunks through the prefill kernel, so decode
            # rows do not pad the prefill kernel's query blocks (vLLM splits batches alike).
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            attn(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                 meta.query_start_loc[: nd + 1], scale, k_scale, v_scale, out=out[:nd],
                 max_query_len=1, max_seq_len=meta.max_decode_seq_len or None, options=options)
            attn(q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
                 meta.prefill_query_start_loc, scale, k_scale, v_scale, out=out[nd:],
                 max_query_len=meta.max_query_len,
                 max_seq_len=meta.max_seq_len if meta.max_seq_len > 0 else None, options=options)
            return out
        return attn(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                    scale, k_scale, v_scale, max_query_len=meta.max_query_len,
                    max_seq_len=meta.max_seq_len if meta.max_seq_len > 0 else None, options=options)
    if k_scale is not None:  # fp8 cache on CPU: dequantize only the blocks this batch reads
        k_cache, v_cache, meta = _dequantize_used_blocks(k_cache, v_cache, meta, q.dtype, k_scale, v_scale)
    return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)


def _dequantize_used_blocks(k_cache, v_cache, meta: AttentionMetadata, dtype: torch.dtype, k_scale, v_scale):
    """The blocks of an fp8 cache ``[num_blocks, block_size, Hkv, D]`` that the batch's block
    tables cover (``ceil(seq_len / block_size)`` per sequence), dequantized to ``dtype`` into a
    compact cache ``[num_used, block_size, Hkv, D]``, and the metadata with block tables
    renumbered into it.  Work and memory scale with the batch's context, not with the pool
    (converting the whole pool every layer made an fp8-KV server on the CPU stall as soon as
    the pool was large).  Which blocks, and the renumbered tables, depend on the step's
    metadata only: computed by the first layer of a forward, reused by the others
    (:func:`_step_compact_blocks`); each layer only dequantizes its own cache.

    Args:
        k_cache, v_cache: float8_e4m3fn [num_blocks, block_size, Hkv, D].
        meta: the step's batch layout (not modified; it caches the compact layout).
        dtype: the dtype to dequantize to (the query's).
        k_scale, v_scale: per-KV-head scales, broadcastable to [Hkv, D].
    Returns:
        (k, v, meta): ``dtype`` [num_used, block_size, Hkv, D] each, and the metadata whose
        block tables index them.
    """
    compact = _step_compact_blocks(meta, k_cache)
    k = k_cache.index_select(0, compact.used).to(dtype) * k_scale
    v = v_cache.index_select(0, compact.used).to(dtype) * v_scale
    return k, v, compact.meta


@dataclasses.dataclass(frozen=True, eq=False)
class _CompactBlocks:
    """Where one step's batch reads an fp8 cache: the pool blocks its block tables cover and
    the metadata renumbered into a compact cache of only those blocks.  It depends on the
    metadata and the pool's shape, not on the layer."""

    # int64 [num_used]: pool block ids the batch reads, ascending ([0] when it reads none).
    used: torch.Tensor
    # The step's metadata with block_tables renumbered into [0, num_used) (same dtype and
    # shape as the original's first ``max ceil(seq_len / block_size)`` columns).
    meta: AttentionMetadata
    # What it was computed from: the metadata's block table tensor (compared by identity)
    # and (seq_lens_list as a tuple, num_blocks, block_size, device) (compared by value).
    block_tables: torch.Tensor
    key: tuple


# Attribute of an AttentionMetadata under which its _CompactBlocks is kept: the model runner
# builds a new metadata object every step, so a step never sees an earlier step's blocks.
_COMPACT_ATTR = "_kiln_fp8_compact_blocks"


def _step_compact_blocks(meta: AttentionMetadata, k_cache: torch.Tensor) -> _CompactBlocks:
    """:func:`_compact_blocks` of ``meta`` over a pool shaped like ``k_cache``, computed once
    per metadata object and kept on it (every layer of a forward gets the same metadata).  It
    is recomputed when the metadata's block table tensor is replaced, its ``seq_lens_list``
    changes or the pool's shape or device differs (a metadata object reused across steps)."""
    key = (tuple(meta.seq_lens_list), k_cache.shape[0], k_cache.shape[1], k_cache.device)
    cached = getattr(meta, _COMPACT_ATTR, None)
    if cached is None or cached.block_tables is not meta.block_tables or cached.key != key:
        cached = _compact_blocks(meta, k_cache.shape[0], k_cache.shape[1], k_cache.device)
        setattr(meta, _COMPACT_ATTR, cached)
    return cached


def _compact_blocks(meta: AttentionMetadata, num_blocks: int, block_size: int, device: torch.device) -> _CompactBlocks:
    """The pool blocks the batch's block tables cover (``ceil(seq_len / block_size)`` entries
    per sequence; entries past them are ignored, whatever they hold) and the tables
    renumbered into a compact cache of those blocks, in ascending block id order.

    Args:
        meta: the step's batch layout.
        num_blocks: blocks in the pool (block ids outside ``[0, num_blocks)`` are clamped).
        block_size: tokens per block.
        device: the pool's device.
    """
    bs = block_size
    nblk = torch.tensor([(n + bs - 1) // bs for n in meta.seq_lens_list], device=device)
    width = max(1, int(nblk.max()) if len(nblk) else 1)
    bt = meta.block_tables[:, :width].to(torch.int64)
    cover = torch.arange(bt.shape[1], device=device).unsqueeze(0) < nblk.unsqueeze(1)
    used = torch.unique(bt[cover])
    if used.numel() == 0:
        used = torch.zeros(1, dtype=torch.int64, device=device)
    remap = torch.zeros(num_blocks, dtype=torch.int64, device=device)
    remap[used] = torch.arange(used.numel(), device=device)
    tables = torch.where(cover, remap[bt.clamp(0, num_blocks - 1)], 0).to(meta.block_tables.dtype)
    key = (tuple(meta.seq_lens_list), num_blocks, block_size, torch.device(device))
    return _CompactBlocks(used, dataclasses.replace(meta, block_tables=tables), meta.block_tables, key)
