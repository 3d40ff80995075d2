"""This rank's slice of a full (unsharded) engine tensor: engines are sharded at load, so one
engine folder (one engine hash) serves every tensor-parallel size.

Which dimension a tensor is split on follows from its layer and its role:

=========================  =================================  ===============================
layer                      split on the output dim (N)        split on the input dim (K)
=========================  =================================  ===============================
column-parallel (QKV,      ``weight``, ``weight_scale`` (FP8,  -- (``smooth_inv`` replicated)
gate-up), vocab shards     INT8 per channel), ``bias``: dim 0;
                           int4 ``qweight``/``scales``/
                           ``qzeros`` [K/8 | K/G, N]: dim 1
row-parallel (o, down)     -- (``weight_scale``, ``bias``     ``weight`` dim 1; int4 ``qweight``
                           replicated)                        /``scales``/``qzeros`` dim 0 (whole
                                                              groups: K/tp is a multiple of the
                                                              group size); ``smooth_inv`` dim 0
=========================  =================================  ===============================

Fused outputs are split part by part (Q | K | V heads, with the KV replication rule; gate | up).
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.layers import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                            VocabParallelEmbedding)

_OUT_DIM = {"weight": 0, "weight_scale": 0, "bias": 0, "qweight": 1, "scales": 1, "qzeros": 1}
_IN_DIM = {"weight": 1, "qweight": 0, "scales": 0, "qzeros": 0, "smooth_inv": 0}


def _parts(mod: ColumnParallelLinear) -> list[tuple[int, int, int]]:
    """``(full size, index of this rank's slice, slice size)`` of each fused output part, in
    units of the layer's full output features."""
    tp, r = mod.tp_size, mod.tp_rank
    if isinstance(mod, QKVParallelLinear):
        d, kv = mod.head_dim, mod.total_num_kv_heads
        kv_idx = r if tp <= kv else r * kv // tp
        return [(mod.num_heads * tp * d, r, mod.num_heads * d),
                (kv * d, kv_idx, mod.num_kv_heads * d), (kv * d, kv_idx, mod.num_kv_heads * d)]
    if isinstance(mod, MergedColumnParallelLinear):
        return [(n, r, n // tp) for n in mod.output_sizes]
    return [(mod.out_features, r, mod.out_features // tp)]


def shard_tensor(model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the engine tensor ``name`` (its full shape), or ``full`` itself
    for a replicated one.

    Raises:
        ValueError: a size that does not split (a corrupt engine or a model mismatch).
    """
    mod_name, _, buf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if isinstance(mod, VocabParallelEmbedding) and buf in _OUT_DIM:
        dim = _OUT_DIM[buf]
        n = mod.num_per_rank
        pad = n * mod.tp_size - full.shape[dim]
        if pad:
            shape = list(full.shape)
            shape[dim] = pad
            full = torch.cat([full, full.new_zeros(shape)], dim=dim)
        return full.narrow(dim, mod.vocab_start, n)
    if isinstance(mod, ColumnParallelLinear) and buf in _OUT_DIM:
        dim = _OUT_DIM[buf]
        parts, offset = [], 0
        for size, idx, local in _parts(mod):
            parts.append(full.narrow(dim, offset + idx * local, local))
            offset += size
        if offset != full.shape[dim]:
            raise ValueError(f"{name}: {full.shape[dim]} output features, the model expects {offset}")
        return torch.cat(parts, dim=dim)
    if isinstance(mod, RowParallelLinear) and buf in _IN_DIM:
        dim = _IN_DIM[buf]
        if full.shape[dim] % mod.tp_size:
            raise ValueError(f"{name}: dimension {dim} of {tuple(full.shape)} does not split over {mod.tp_size} ranks")
        local = full.shape[dim] // mod.tp_size
        return full.narrow(dim, mod.tp_rank * local, local)
    return full
