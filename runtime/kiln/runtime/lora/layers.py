"""LoRA as a transform of the model: each target linear's ``quant_method`` is wrapped by a
:class:`LoRALinearMethod`, which runs the base matmul (float, int4, fp8: whatever method the
layer had) and adds the batched adapter delta of every token to its output.  The model code
is untouched (gpt-fast's features-as-transforms); the linear keeps its parameters and names.

The wrap also hides a base method's fused SwiGLU epilogue (``apply_silu_and_mul``), so an
int4 gate|up projection with LoRA runs matmul -> delta -> SiLU-and-mul.

Tensor parallelism (``layer.tp_size`` > 1; ``load_slot`` slices this rank's part): on a
column-parallel layer (QKV, gate|up) A is replicated and B is sharded on its output rows like
the weight; on a row-parallel layer (o, down) A is sharded on its input columns like the
weight and B is replicated: the delta of the partial input adds to the partial output before
the layer's all-reduce, which sums both, so LoRA needs no communication of its own.
"""

from __future__ import annotations

import torch

from kiln.kernels.lora import lora_expand_ref, lora_segments, lora_shrink_ref

from ..model import ops


class LoRABatch:
    """The step's token -> device slot mapping, in persistent buffers (CUDA graphs read
    them).

    Args:
        max_num_tokens: the most tokens a forward carries (token budget, largest graph).
        num_slots: ``max_loras``.
        device: the model's device; on CUDA the Triton kernels run, else the torch reference.
    """

    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.use_triton = device.type == "cuda"
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.sorted_token_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.counts = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.starts = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.num_tokens = 0  # tokens of the forward the mapping was set for
        self.active = False  # some token of it has an adapter (or a graph is being captured)

    def set(self, token_slots: list[int], active: bool | None = None) -> None:
        """Map this step's tokens (slot per token, -1: base) and group them by slot."""
        T = len(token_slots)
        if T > self.token_slots.numel():
            raise ValueError(f"a forward of {T} tokens exceeds the LoRA mapping's {self.token_slots.numel()}")
        self.num_tokens = T
        self.active = any(s >= 0 for s in token_slots) if active is None else active
        if not self.active or T == 0:
            return
        src = torch.tensor(token_slots, dtype=torch.int32)
        dst = self.token_slots[:T]
        dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)
        ids, counts, starts = lora_segments(dst, self.num_slots)
        self.sorted_token_ids[:T].copy_(ids)
        self.counts.copy_(counts)
        self.starts.copy_(starts)

    def applies_to(self, num_tokens: int) -> bool:
        """True when a forward of ``num_tokens`` must add adapter deltas.  A forward the
        mapping was not set for (kernel warm-up's synthetic steps) runs on the base."""
        return self.active and num_tokens == self.num_tokens


class LoRALinearMethod:
    """A linear's method with the batched LoRA delta added.

    Args:
        base: the layer's previous ``quant_method`` (None: the float ``ops.linear``).
        batch: the shared :class:`LoRABatch`.
        in_features: this rank's input features (K).
        slice_sizes: this rank's output features of each fused part (q|k|v, gate|up, one
            part for o and down).
        num_slots, max_rank: buffer sizes (``max_loras``, ``max_lora_rank``).
    Buffers: ``lora_a`` [S, parts*R, K] (the parts' A stacked, one shrink for all) and
    ``lora_b`` [S, sum N_i, R] (the parts' B stacked along the output features, one expand
    for all), model dtype; a slot without an adapter (or an adapter not targeting a part) is
    zero there.
    """

    def __init__(self, base, batch: LoRABatch, in_features: int, slice_sizes: list[int], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        self.base = base
        self.batch = batch
        self.rank = max_rank
        self.slice_sizes = list(slice_sizes)
        self.lora_a = torch.zeros(num_slots, len(slice_sizes) * max_rank, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, sum(slice_sizes), max_rank, dtype=dtype, device=device)
        self._part_starts = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]

    def apply(self, layer, x: torch.Tensor, **kwargs) -> torch.Tensor:  # x: [T, K] -> [T, N]
        if self.base is not None:
            y = self.base.apply(layer, x, **kwargs)
        else:
            y = ops.linear(x, layer.weight, layer.bias, layer.kernel_options, **kwargs)
        b = self.batch
        if not b.applies_to(x.shape[0]):
            return y
        return self.add_delta(x, y)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y += delta`` of each token's adapter (in place); returns ``y``."""
        b, T = self.batch, x.shape[0]
        if b.use_triton:
            from kiln.kernels.lora import lora_expand, lora_shrink  # noqa: PLC0415  (Triton)

            seg = (b.sorted_token_ids[:T], b.counts, b.starts)
            h = lora_shrink(x, self.lora_a, *seg)
            return lora_expand(y, h, self.lora_b, *seg, part_sizes=self.slice_sizes)
        slots = b.token_slots[:T]
        h = lora_shrink_ref(x, self.lora_a, slots)
        return lora_expand_ref(y, h, self.lora_b, slots, part_sizes=self.slice_sizes)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put one part's ``A`` [r, K] and scaled ``B`` [N_i, r] (this rank's slices) into
        ``slot``; ranks below ``max_rank`` are zero-padded."""
        r, R, c = a.shape[0], self.rank, self._part_starts[part]
        self.lora_a[slot, part * R:part * R + r].copy_(a)
        self.lora_b[slot, c:c + self.slice_sizes[part], :r].copy_(b)
