"""Layers of Kiln's model code.  Linear layers are shaped for tensor parallelism (Megatron-LM,
Shoeybi et al., 2019; the layout follows vLLM / nano-vllm): a column-parallel layer shards
its output features over ``tp_size`` ranks, a row-parallel layer shards its input features
and all-reduces.  Each parameter carries a ``weight_loader(param, loaded_weight, shard_id)``
that copies this rank's slice of a checkpoint tensor, so fused projections (QKV, gate-up)
load from the checkpoint's separate tensors.  With ``tp_size == 1`` the all-reduce is the
identity; with more ranks the collectives run on ``torch.distributed``'s default group
(``kiln.runtime.distributed.parallel``).  Engines are sharded at load: the loaders narrow
each full tensor to this rank's slice.

Every module that launches kernels carries ``kernel_options`` (``kiln.kernels.options.
KernelOptions``, the defaults until ``set_kernel_options`` applies an engine's choice)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
import torch.nn.functional as F

from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.reference import build_cos_sin_cache

from . import ops


def set_kernel_options(model: nn.Module, options: KernelOptions) -> None:
    """Give every module of ``model`` that launches kernels (it has a ``kernel_options``
    attribute) the engine's ``options``; quantized linears read them from their layer."""
    for mod in model.modules():
        if hasattr(mod, "kernel_options"):
            mod.kernel_options = options


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole checkpoint tensor into ``param``.

    Raises:
        ValueError: shapes differ (a corrupt or mismatched checkpoint).
    """
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W``: [out_features_per_rank, in_features_per_rank].

    ``quant_method`` (set by quantization transforms) replaces the matmul; by default it is
    ``ops.linear``: ``F.linear``, or on CUDA at small M the Triton GEMV where it beats cuBLAS.
    """

    kernel_options: KernelOptions = DEFAULT_OPTIONS
    # (input, FP8 q, scales) left by the norm that produced the input (take_prequantized)
    prequantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.quant_method: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in]
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        return ops.linear(x, self.weight, self.bias, self.kernel_options)

    def take_prequantized(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The FP8 ``(q, scales)`` of ``x`` that the norm before this layer wrote with it
        (``RMSNorm.forward(quant_for=...)``), once: None when ``x`` is another tensor."""
        pre, self.prequantized = self.prequantized, None
        return (pre[1], pre[2]) if pre is not None and pre[0] is x else None

    def full_row_absmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """float32 [T, 1] ``max|x[t, :]|`` over the layer's whole input row when ``x`` [T, in/tp]
        holds only this rank's part of it (a row-parallel layer at tp > 1), else None: what a
        per-token activation quantizer (FP8, INT8) scales by, so each rank rounds its shard
        exactly as one rank rounds the whole row."""
        return None


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kw: Any):
        super().__init__(in_features, out_features, bias, **kw)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        _set_loader(self.weight, default_weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            _set_loader(self.bias, default_weight_loader)
        else:
            self.register_parameter("bias", None)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: rank r holds rows ``[r*out/tp, (r+1)*out/tp)`` of W."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        if out_features % tp_size:
            raise ValueError(f"out_features {out_features} not divisible by tp_size {tp_size}")
        super().__init__(in_features, out_features, bias, tp_size, tp_rank)
        per_rank = out_features // tp_size
        self.weight = nn.Parameter(torch.empty(per_rank, in_features), requires_grad=False)
        _set_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(per_rank), requires_grad=False)
            _set_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate and up projections).

    ``output_sizes`` are the full (unsharded) sizes; ``shard_id`` is the index of the part.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, tp_size, tp_rank)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        part = loaded_weight.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K and V projections: output rows are [q heads | k heads | v heads] of this rank.

    ``shard_id`` is "q", "k" or "v".
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0):
        if num_heads % tp_size or (num_kv_heads % tp_size and tp_size % num_kv_heads):
            raise ValueError(f"heads ({num_heads} q, {num_kv_heads} kv) do not split over tp_size {tp_size}")
        self.head_dim = head_dim
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_size, tp_rank)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        if shard_id == "q" or self.tp_size <= self.total_num_kv_heads:
            rank = self.tp_rank
        else:  # more ranks than KV heads: each KV head is replicated on tp/kv ranks
            rank = self.tp_rank * self.total_num_kv_heads // self.tp_size
        part = loaded_weight.narrow(0, rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are all-reduced (identity at tp=1)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        if in_features % tp_size:
            raise ValueError(f"in_features {in_features} not divisible by tp_size {tp_size}")
        super().__init__(in_features, out_features, bias, tp_size, tp_rank)
        per_rank = in_features // tp_size
        self.weight = nn.Parameter(torch.empty(out_features, per_rank), requires_grad=False)
        _set_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            _set_loader(self.bias, default_weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        size = param.shape[1]
        default_weight_loader(param, loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.tp_size > 1:
            torch.distributed.all_reduce(y)
        return y

    def full_row_absmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shards' per-token ``max|x|`` all-reduced with MAX (float32 [T, 1]); None at tp = 1."""
        if self.tp_size == 1:
            return None
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        return amax


class VocabParallelEmbedding(nn.Module):
    """Token embedding table ``[vocab, hidden]``; with ``tp_size > 1`` rank r holds rows
    ``[r*P, (r+1)*P)`` with ``P = ceil(vocab / tp)`` (the last shard zero-padded), looks up
    the ids it owns, zeroes the others and all-reduces (Megatron-LM's vocab-parallel embedding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.num_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_per_rank, embedding_dim), requires_grad=False)
        _set_loader(self.weight, self.weight_loader if tp_size > 1 else default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's rows of the full ``[vocab, hidden]`` table (padding rows zeroed)."""
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"shape mismatch: vocabulary {self.num_embeddings} vs checkpoint {tuple(loaded_weight.shape)}")
        n = max(0, min(self.num_per_rank, self.num_embeddings - self.vocab_start))
        param.data.zero_()
        default_weight_loader(param.data.narrow(0, 0, n), loaded_weight.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_per_rank)
        out = F.embedding(local * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        torch.distributed.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits; may share its weight with the embedding.

    A quantized engine may quantize the head too (``kiln build --quantize-lm-head``): then
    ``quant_method`` (an int4 ``LinearMethod``) owns its buffers and computes the logits, and
    a tied embedding keeps the float table for the lookups.
    """

    bias = None  # read by LinearMethod.apply
    quant_method = None
    kernel_options: KernelOptions = DEFAULT_OPTIONS

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [S, hidden] (model dtype) -> float32 logits [S, vocab]; with
        ``tp_size > 1`` every rank computes its vocabulary shard and the shards are
        all-gathered (padding columns dropped)."""
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden, out_dtype=torch.float32)
        else:
            logits = ops.linear(hidden, self.weight, None, self.kernel_options, out_dtype=torch.float32)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, : self.num_embeddings]


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (``forward(x, residual)``)."""

    kernel_options: KernelOptions = DEFAULT_OPTIONS

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        _set_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant_for: "LinearBase | None" = None):
        """``quant_for``: the linear that reads the output.  When its method takes a
        pre-quantized FP8 input (``accepts_prequantized``), one kernel also quantizes the
        output per token and hands it over (``LinearBase.prequantized``)."""
        if quant_for is not None and getattr(quant_for.quant_method, "accepts_prequantized", False):
            fused = ops.rms_norm_quant_fp8(x, self.weight, self.eps, residual, self.kernel_options)
            if fused is not None:
                out, res_out, q, scale = fused
                quant_for.prequantized = (out, q, scale)
                return out if residual is None else (out, res_out)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, self.kernel_options)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.kernel_options)


class RotaryEmbedding(nn.Module):
    """Holds the float32 ``[max_position, head_dim]`` cos|sin table (``reference.
    build_cos_sin_cache``: default, linear and Llama-3 scaling) and applies RoPE."""

    kernel_options: KernelOptions = DEFAULT_OPTIONS

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None):
        super().__init__()
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(head_dim, max_position, base, rope_scaling),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.kernel_options)


class SiluAndMul(nn.Module):
    """SwiGLU activation on a fused gate|up tensor."""

    kernel_options: KernelOptions = DEFAULT_OPTIONS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x, self.kernel_options)
