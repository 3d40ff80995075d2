"""Batched LoRA kernels (Punica's SGMV, Chen et al., 2023; S-LoRA, Sheng et al., 2023):
one forward serves tokens of many adapters.

A step's tokens each carry a device *slot* (``token_slots`` int32 [T], -1: no adapter).
``lora_segments`` sorts the token indices by slot on the device (a stable sort, so no host
sync and CUDA-graph safe), giving each slot a segment of ``sorted_token_ids``; the Triton
kernels then run one grid axis over the slots and gather their segment's rows:

* ``lora_shrink``: ``h[t] = x[t] @ A[slot(t)].T`` (``[T, K] x [S, R, K] -> [T, R]`` float32),
* ``lora_expand``: ``y[t, off:off+N] += h[t] @ B[slot(t)].T`` (``[T, R] x [S, N, R]``),

the LoRA scaling (``alpha / r`` or rsLoRA's ``alpha / sqrt(r)``) folded into ``B`` when the
adapter is loaded.  Ranks below the buffers' ``R`` are zero-padded, which leaves the
product exact.  ``reference`` holds the torch versions (the CPU runtime path).  vLLM's
``lora_shrink_op`` / ``lora_expand_op`` follow the same plan.
"""

from __future__ import annotations

from .reference import lora_expand_ref, lora_segments, lora_shrink_ref

__all__ = ["lora_expand", "lora_expand_ref", "lora_segments", "lora_shrink", "lora_shrink_ref"]


def __getattr__(name: str):
    """``lora_shrink`` / ``lora_expand`` import Triton on first use."""
    if name == "lora_shrink":
        from .shrink import lora_shrink  # noqa: PLC0415

        return lora_shrink
    if name == "lora_expand":
        from .expand import lora_expand  # noqa: PLC0415

        return lora_expand
    raise AttributeError(f"module 'kiln.kernels.lora' has no attribute {name!r}")
