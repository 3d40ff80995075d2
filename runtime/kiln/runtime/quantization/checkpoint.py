"""Pre-quantized checkpoints: a Hugging Face folder whose ``config.json`` carries a
``quantization_config`` is loaded into Kiln's own serving formats without quantizing again.

=====================================================  =====================  ==============
checkpoint (``quantization_config``)                   Kiln serving method    weights
=====================================================  =====================  ==============
compressed-tensors ``float-quantized`` FP8 W8A8         ``fp8``                as stored
(llm-compressor ``FP8_DYNAMIC``: channel or tensor
weight scales, dynamic per-token activations)
compressed-tensors ``int-quantized`` INT8 W8A8          ``int8``               as stored
(llm-compressor ``W8A8``: channel weight scales,
dynamic per-token symmetric activations)
compressed-tensors ``pack-quantized`` W4A16             ``int4``               repacked
(llm-compressor ``W4A16`` / ``W4A16_ASYM``, group G)
GPTQ (``quant_method: gptq``, 4 bits, ``desc_act``      ``int4``               repacked
false, sym or asym, ``gptq`` / ``gptq_v2`` format)
AutoAWQ (``quant_method: awq``, ``version: gemm``,      ``int4``               repacked
4 bits, zero point)
=====================================================  =====================  ==============

``int4`` is the packed format of ``kiln.kernels.int4_format`` (the W4A16 kernels of
``int4-awq`` / ``int4-gptq`` engines); the codes are the checkpoint's, the scales are rounded
once to float16 (a checkpoint's bfloat16 / float32 scales).  ``int8`` is ``int8-smoothquant``'s
GEMM without a runtime smoothing vector (llm-compressor folds SmoothQuant into the norms) and
with the activations on compressed-tensors' grid (``max|x| / 127.5``, codes -128..127).

Every decoder linear must carry the one scheme; the embeddings, norms and LM head must be
float (llm-compressor's default ``ignore: [lm_head]``).  Anything else (static activation
scales, activation order, 3 or 8 bit GPTQ, a KV cache scheme, sparsity, transforms, a
quantized LM head) is refused with ``CheckpointFormatError`` naming the field.  The layouts
read are in ``checkpoint_formats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .base import QuantSettings, model_linears
from .checkpoint_formats import (
    CheckpointFormatError,
    unpack_awq,
    unpack_ct_float,
    unpack_ct_int8,
    unpack_ct_packed,
    unpack_gptq,
)
from .int4 import pack

__all__ = ["CheckpointFormatError", "CheckpointQuant", "detect", "load_checkpoint", "FUSED_PARTS"]

# Kiln's fused linear (name inside a decoder layer) -> the Hugging Face linears it concatenates
FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "self_attn.o_proj": ("self_attn.o_proj",),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
               "mlp.down_proj": ("mlp.down_proj",)}


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's ``quantization_config`` declares, as Kiln will serve it.

    Fields:
        method: the Kiln serving method (``fp8``, ``int8`` or ``int4``; ``registry``).
        group_size: int4 columns per scale group (0: one group per row, the layer's K).
        suffixes: the tensor-name suffixes of a quantized linear in this format.
        unpack: ``(parts, prefix, N, K, G) -> Kiln tensors`` of one linear (``checkpoint_formats``).
        record: the checkpoint's method as the engine manifest records it.
    """

    method: str
    group_size: int
    suffixes: tuple[str, ...]
    unpack: Callable[..., dict[str, torch.Tensor]]
    record: dict[str, Any] = field(default_factory=dict)

    def settings(self, group_size: int | None = None) -> QuantSettings:
        """The ``QuantSettings`` an engine of this checkpoint is served with."""
        return QuantSettings(method=self.method, group_size=group_size or self.group_size or 128,
                             extra={"checkpoint": dict(self.record)})

    def describe(self) -> str:
        r = self.record
        return f"{r['quant_method']} {r.get('scheme', '')}".strip()


def _field(d: dict, key: str, where: str):
    if key not in d:
        raise CheckpointFormatError(f"{where}.{key} is missing")
    return d[key]


def _bad(where: str, value: Any, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where} = {value!r}: {why}")


def _group_size(value: Any, where: str, allow_row: bool = False) -> int:
    """A checkpoint's group size as an int (``-1``: one group per row, where ``allow_row``).

    Raises:
        CheckpointFormatError: naming ``where``, for a value that is not a positive integer.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _bad(where, value, "expected a positive integer")
    try:
        gs = int(value)
    except ValueError:
        raise _bad(where, value, "expected a positive integer") from None
    if gs <= 0 and not (allow_row and gs == -1):
        raise _bad(where, value, "expected a positive integer" + (" or -1 (one group per row)" if allow_row else ""))
    return gs


def _detect_compressed_tensors(qc: dict) -> CheckpointQuant:
    w0 = "quantization_config"
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise _bad(f"{w0}.{key}", "set", "not supported (Kiln loads weight/activation quantization only)")
    groups = _field(qc, "config_groups", w0)
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _bad(f"{w0}.config_groups", f"{len(groups) if isinstance(groups, dict) else groups} groups",
                   "Kiln serves one scheme for every linear; expected exactly one group")
    gname, g = next(iter(groups.items()))
    where = f"{w0}.config_groups.{gname}"
    fmt = g.get("format") or qc.get("format")
    w = _field(g, "weights", where) or {}
    a = g.get("input_activations")
    if g.get("output_activations"):
        raise _bad(f"{where}.output_activations", "set", "output quantization is not supported")
    bits, wtype, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if w.get("dynamic"):
        raise _bad(f"{where}.weights.dynamic", True, "dynamic weight quantization is not supported")
    record = {"quant_method": "compressed-tensors", "format": fmt, "version": qc.get("version"),
              "weights": {"num_bits": bits, "type": wtype, "strategy": strategy,
                          "symmetric": w.get("symmetric"), "group_size": w.get("group_size")},
              "input_activations": None if not a else {"num_bits": a.get("num_bits"), "type": a.get("type"),
                                                       "strategy": a.get("strategy"), "dynamic": a.get("dynamic")}}
    if fmt in ("float-quantized", "int-quantized"):
        is_fp8 = fmt == "float-quantized"
        if (wtype, bits) != (("float", 8) if is_fp8 else ("int", 8)):
            raise _bad(f"{where}.weights", f"{wtype} {bits} bits", f"format {fmt} needs "
                       + ("float 8 bits (FP8 E4M3)" if is_fp8 else "int 8 bits"))
        if strategy not in ("channel", "tensor"):
            raise _bad(f"{where}.weights.strategy", strategy, "Kiln's W8A8 formats take channel or tensor scales")
        if not w.get("symmetric", True):
            raise _bad(f"{where}.weights.symmetric", False, "asymmetric 8-bit weights are not supported")
        if not a:
            raise _bad(f"{where}.input_activations", None, "weight-only 8-bit is not supported (W8A8 only)")
        if not a.get("dynamic"):
            raise _bad(f"{where}.input_activations.dynamic", a.get("dynamic"),
                       "static activation scales are not supported; use dynamic per-token activations (FP8_DYNAMIC, W8A8)")
        if a.get("strategy") != "token" or (a.get("type"), a.get("num_bits")) != (wtype, 8) or not a.get("symmetric", True):
            raise _bad(f"{where}.input_activations", f"{a.get('type')} {a.get('num_bits')} bits {a.get('strategy')}",
                       f"Kiln quantizes activations symmetric per token in {wtype} 8 bits")
        record["scheme"] = "FP8 W8A8 dynamic" if is_fp8 else "INT8 W8A8 dynamic"
        return CheckpointQuant("fp8" if is_fp8 else "int8", 0, ("weight", "weight_scale"),
                               (lambda p, pre, n, k, g: unpack_ct_float(p, pre, n, k)) if is_fp8 else
                               (lambda p, pre, n, k, g: unpack_ct_int8(p, pre, n, k)), record)
    if fmt == "pack-quantized":
        if (wtype, bits) != ("int", 4):
            raise _bad(f"{where}.weights.num_bits", bits, "Kiln's packed format holds 4-bit int weights")
        if a:
            raise _bad(f"{where}.input_activations", "set", "pack-quantized with activation quantization is not supported")
        if strategy == "group":
            gs = _group_size(_field(w, "group_size", f"{where}.weights"), f"{where}.weights.group_size")
        elif strategy == "channel":
            gs = 0
        else:
            raise _bad(f"{where}.weights.strategy", strategy, "expected group or channel")
        if w.get("actorder") == "group":
            raise _bad(f"{where}.weights.actorder", "group", "activation order is not supported (static or none)")
        sym = bool(w.get("symmetric", True))
        record["scheme"] = "W4A16" + ("" if sym else " asym")
        suffixes = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
        return CheckpointQuant("int4", gs, suffixes, partial(_ct_packed, symmetric=sym), record)
    raise _bad(f"{w0}.format", fmt, "supported compressed-tensors formats: float-quantized, int-quantized, pack-quantized")


def _ct_packed(parts, prefix, n, k, g, symmetric):
    return unpack_ct_packed(parts, prefix, n, k, g or k, symmetric)


def _detect_gptq(qc: dict) -> CheckpointQuant:
    w0 = "quantization_config"
    bits = _field(qc, "bits", w0)
    if bits != 4:
        raise _bad(f"{w0}.bits", bits, "Kiln serves 4-bit GPTQ only")
    if qc.get("desc_act"):
        raise _bad(f"{w0}.desc_act", True, "activation order is not supported; quantize with desc_act false")
    if qc.get("lm_head"):
        raise _bad(f"{w0}.lm_head", True, "a quantized LM head is not supported")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _bad(f"{w0}.checkpoint_format", fmt, "supported: gptq, gptq_v2")
    gs = _group_size(qc.get("group_size", 128), f"{w0}.group_size", allow_row=True)
    sym = bool(qc.get("sym", True))
    record = {"quant_method": "gptq", "scheme": "W4A16" + ("" if sym else " asym"), "bits": 4, "group_size": gs,
              "sym": sym, "desc_act": False, "checkpoint_format": fmt}
    offset = 1 if fmt == "gptq" else 0
    return CheckpointQuant("int4", 0 if gs == -1 else gs, ("qweight", "qzeros", "scales", "g_idx"),
                           lambda p, pre, n, k, g: unpack_gptq(p, pre, n, k, g or k, offset), record)


def _detect_awq(qc: dict) -> CheckpointQuant:
    w0 = "quantization_config"
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _bad(f"{w0}.bits", bits, "Kiln serves 4-bit AWQ only")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _bad(f"{w0}.version", qc.get("version"), "supported: gemm")
    if not qc.get("zero_point", True):
        raise _bad(f"{w0}.zero_point", False, "AutoAWQ GEMM checkpoints have zero points")
    gs = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), f"{w0}.group_size")
    record = {"quant_method": "awq", "scheme": "W4A16", "bits": 4, "group_size": gs, "version": "gemm",
              "zero_point": True}
    return CheckpointQuant("int4", gs, ("qweight", "qzeros", "scales"),
                           lambda p, pre, n, k, g: unpack_awq(p, pre, n, k, g), record)


def detect(config: dict) -> CheckpointQuant | None:
    """The pre-quantization a Hugging Face ``config.json`` declares, or None (float weights).

    Raises:
        CheckpointFormatError: an unknown ``quant_method`` or an unsupported setting (names the field).
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise _bad("quantization_config", type(qc).__name__, "expected an object")
    qm = str(qc.get("quant_method", "")).lower()
    if qm == "compressed-tensors":
        return _detect_compressed_tensors(qc)
    if qm == "gptq":
        return _detect_gptq(qc)
    if qm == "awq":
        return _detect_awq(qc)
    raise _bad("quantization_config.quant_method", qc.get("quant_method"),
               "unknown; Kiln loads compressed-tensors, gptq and awq checkpoints")


def _fuse(cq: CheckpointQuant, parts: list[dict[str, torch.Tensor]], k: int) -> dict[str, torch.Tensor]:
    """Concatenate per-part Kiln tensors along the output features; int4 is packed here."""
    cat = {key: torch.cat([p[key] for p in parts], dim=0) for key in parts[0]}
    if cq.method != "int4":
        return cat
    return pack(cat["codes"], cat["scales"], cat["zeros"])


def _hf_parts(name: str) -> list[str]:
    """The Hugging Face linears of one Kiln linear: ``model.layers.3.self_attn.qkv_proj`` ->
    ``[model.layers.3.self_attn.q_proj, ...k_proj, ...v_proj]``."""
    for inner, parts in FUSED_PARTS.items():
        if name.endswith("." + inner):
            layer = name[: -len(inner) - 1]
            return [f"{layer}.{p}" for p in parts]
    raise CheckpointFormatError(f"{name}: no Hugging Face layout known for this linear")


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], cq: CheckpointQuant) -> QuantSettings:
    """Load a pre-quantized checkpoint's tensors into a freshly built Kiln model (float
    parameters, any tensor-parallel size): every decoder linear gets its serving method's
    buffers (``registry.convert_for_runtime``), filled from the checkpoint's tensors
    unpacked, fused and (int4) repacked at their full size, then cut to this rank's slice as
    an engine's are (``distributed.shard.shard_tensor``); the other weights load through
    ``load_weights``.

    Args:
        model: a ``LlamaForCausalLM`` as built (float weights, any device).
        weights: ``(hf_name, tensor)`` of the checkpoint (``loader.iter_weights``).
        cq: what ``detect`` found in the checkpoint's config.
    Returns:
        The ``QuantSettings`` the model now runs (the engine manifest's ``quantization``).
    Raises:
        CheckpointFormatError: a missing, extra or misshapen tensor (names it), a group size
            that does not divide a layer, a decoder linear stored unquantized.
        ValueError: a per-channel int4 checkpoint at tensor-parallel size > 1 (its one group
            per row has another width on the row-parallel ranks).
    """
    from ..distributed.shard import shard_tensor  # noqa: PLC0415
    from .registry import convert_for_runtime  # noqa: PLC0415  (the registry imports every method)

    linears = dict(model_linears(model))
    tp = max(m.tp_size for m in linears.values())
    if tp > 1 and cq.method == "int4" and not cq.group_size:
        raise ValueError(f"a per-channel int4 {cq.describe()} checkpoint (one group per row) is served at "
                         f"tensor-parallel size 1 only, not {tp}: quantize it with a group size")
    shapes = {name: tuple(m.weight.shape) for name, m in linears.items()}  # this rank's [N, K], before the float weights go
    cfg = model.config
    rows = {"q_proj": cfg.num_attention_heads * cfg.head_dim, "k_proj": cfg.num_key_value_heads * cfg.head_dim,
            "v_proj": cfg.num_key_value_heads * cfg.head_dim, "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size}
    # the checkpoint's (unsharded) [N, K] of each Kiln linear
    full = {name: (sum(rows.get(p.rsplit(".", 1)[-1], m.out_features) for p in _hf_parts(name)), m.in_features)
            for name, m in linears.items()}
    if cq.method == "int4" and cq.group_size:
        for name, (n, k) in shapes.items():
            if k % cq.group_size:
                raise CheckpointFormatError(f"group size {cq.group_size} does not divide {name}'s {k} input features")
    group = cq.group_size or min(k for _, k in shapes.values())
    if cq.method == "int4" and any(k != group for _, k in shapes.values()) and not cq.group_size:
        raise CheckpointFormatError("per-channel int4 (one group per row) needs every linear to have the same "
                                    "input features in Kiln's format; quantize with a group size")
    settings = cq.settings(group)
    convert_for_runtime(model, settings)
    linear_parts = {p for name in shapes for p in _hf_parts(name)}
    quant: dict[str, dict[str, torch.Tensor]] = {}

    def floats():
        for name, t in weights:
            prefix, _, suffix = name.rpartition(".")
            if prefix in linear_parts and suffix in cq.suffixes:
                quant.setdefault(prefix, {})[suffix] = t
                continue
            if prefix in linear_parts and suffix == "weight":
                raise CheckpointFormatError(f"{name} is stored unquantized ({str(t.dtype).replace('torch.', '')}): "
                                            f"Kiln serves one {cq.describe()} scheme on every decoder linear")
            yield name, t

    try:
        loaded = model.load_weights(floats())
    except CheckpointFormatError:
        raise
    except (ValueError, RuntimeError) as e:
        raise CheckpointFormatError(str(e)) from e
    missing = sorted({n for n, _ in model.named_parameters()} - loaded)
    if missing:
        raise CheckpointFormatError(f"checkpoint lacks {len(missing)} float tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, (n, k) in full.items():
            hf = _hf_parts(name)
            for p in hf:
                if p not in quant:
                    raise CheckpointFormatError(f"checkpoint lacks the quantized tensors of {p} "
                                                f"({', '.join(s for s in cq.suffixes[:2])}, ...)")
            ns = [rows.get(p.rsplit(".", 1)[-1], n) for p in hf]
            if sum(ns) != n:  # pragma: no cover - the model's own shapes disagree with its config
                raise CheckpointFormatError(f"{name}: parts {ns} do not add up to {n} rows")
            unpacked = [cq.unpack(quant.pop(p), p, pn, k, cq.group_size) for p, pn in zip(hf, ns)]
            fused = _fuse(cq, unpacked, k)
            if tp > 1:
                fused = {key: shard_tensor(model, f"{name}.{key}", t) for key, t in fused.items()}
            _copy_into(linears[name], fused, name)
    if quant:
        extra = sorted(quant)[0]
        raise CheckpointFormatError(f"checkpoint tensor {extra}.{sorted(quant[extra])[0]} has no place in the model")
    return settings


def _copy_into(layer: nn.Module, tensors: dict[str, torch.Tensor], name: str) -> None:
    """Copy fused Kiln tensors into the buffers ``convert_for_runtime`` made on ``layer``."""
    for key, t in tensors.items():
        dst = getattr(layer, key, None)
        if dst is None:  # pragma: no cover - unpacker and serving method disagree
            raise CheckpointFormatError(f"{name}.{key}: the serving method has no such buffer")
        if tuple(dst.shape) != tuple(t.shape):
            raise CheckpointFormatError(f"{name}.{key} is {tuple(t.shape)} after unpacking, the model wants "
                                        f"{tuple(dst.shape)}")
        dst.copy_(t)
