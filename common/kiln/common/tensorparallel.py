"""Whether a model splits over N tensor-parallel ranks: one rule for ``kiln serve`` (checked
before any worker process starts) and for the operator (checked against the engine record
before the Deployment is created or updated).  Standard library only.

The runtime's layout (``kiln.runtime.distributed``, Megatron-LM's) needs:

* the attention heads divisible by N (each rank holds heads / N query heads);
* the KV heads divisible by N, or N a multiple of them (each KV head is then replicated on
  N / KV heads ranks);
* the MLP's intermediate size divisible by N (gate-up split by output, down by input);
* in an int4 engine, each rank's share of a row-parallel layer's input features (o_proj:
  heads x head_dim / N; down_proj: intermediate / N) a multiple of the group size and of the
  64-column block of the packed format (``kiln.kernels.int4_format.KBLOCK``), since engines
  are sharded at load and a rank's slice must hold whole groups and whole packed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["INT4_KBLOCK", "ParallelShape", "tensor_parallel_problem", "check_tensor_parallel"]

INT4_KBLOCK = 64  # kiln.kernels.int4_format.KBLOCK (a test checks that they agree)

_KEYS = {"numAttentionHeads": "num_attention_heads", "numKeyValueHeads": "num_key_value_heads",
         "headDim": "head_dim", "intermediateSize": "intermediate_size", "int4GroupSize": "int4_group_size"}


@dataclass(frozen=True)
class ParallelShape:
    """The sizes of a model that tensor parallelism splits.

    Fields:
        num_attention_heads: query heads.
        num_key_value_heads: KV heads (grouped-query attention; equal to the heads without it).
        head_dim: features per head.
        intermediate_size: the MLP's hidden features.
        int4_group_size: the group size of an int4 engine's weights; None for other engines.
    """

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    int4_group_size: int | None = None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], quantization: Mapping[str, Any] | None = None) -> ParallelShape:
        """From a Hugging Face ``config.json`` dict (head_dim defaults to hidden / heads) and an
        engine manifest's ``quantization`` (``{"method": "int4-awq", "group_size": 128}``).

        Raises:
            ValueError: a missing or non-integer size.
        """
        try:
            heads = int(config["num_attention_heads"])
            kv = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
            inter = int(config["intermediate_size"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise ValueError(f"model config lacks a usable attention or MLP size: {e!r}") from e
        group = None
        q = quantization or {}
        if str(q.get("method") or "").startswith("int4"):
            group = int(q.get("group_size") or 0) or None
        return cls(heads, kv, head_dim, inter, group)

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> ParallelShape:
        """From an engine's ``manifest.json`` (``kiln.common.manifest.read_manifest``)."""
        return cls.from_hf_config((manifest.get("model") or {}).get("config") or {}, manifest.get("quantization"))

    def to_dict(self) -> dict[str, int]:
        """camelCase keys, as the build report and the engine record carry it; no group size
        key for a non-int4 engine."""
        return {k: getattr(self, attr) for k, attr in _KEYS.items() if getattr(self, attr) is not None}

    @classmethod
    def from_dict(cls, d: Any) -> ParallelShape | None:
        """The inverse of ``to_dict``; None for anything else (a record written without it)."""
        if not isinstance(d, Mapping):
            return None
        vals = {attr: d.get(k) for k, attr in _KEYS.items()}
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for a, v in vals.items()
               if a != "int4_group_size" or v is not None):
            return None
        return cls(**vals)


def tensor_parallel_problem(shape: ParallelShape, tp: int, name: str = "tensor parallel size") -> str | None:
    """Why ``tp`` ranks cannot serve a model of ``shape`` (one line with the numbers; ``name``
    names the setting, e.g. ``runtime.tensorParallelSize``), or None when they can."""
    if tp < 1:
        return f"{name} must be at least 1, got {tp}"
    if tp == 1:
        return None
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    if heads % tp or (kv % tp and tp % kv):
        return (f"{name} {tp} does not split the model's {heads} attention heads and {kv} KV heads (it must "
                f"divide the heads, and divide the KV heads or be a multiple of them)")
    if shape.intermediate_size % tp:
        return f"{name} {tp} does not split the model's MLP intermediate size {shape.intermediate_size}"
    g = shape.int4_group_size
    if g:
        for layer, k in (("o_proj", heads * shape.head_dim), ("down_proj", shape.intermediate_size)):
            if k % tp or (k // tp) % g or (k // tp) % INT4_KBLOCK:
                return (f"{name} {tp} does not split the int4 engine's {layer} ({k} input features): each rank's "
                        f"{k / tp:g} must be a multiple of the group size {g} and of {INT4_KBLOCK} (the packed "
                        f"block)")
    return None


def check_tensor_parallel(shape: ParallelShape, tp: int, name: str = "tensor parallel size") -> None:
    """Raises ValueError with ``tensor_parallel_problem``'s line when ``tp`` ranks cannot serve
    a model of ``shape``."""
    problem = tensor_parallel_problem(shape, tp, name)
    if problem:
        raise ValueError(problem)
