"""The quantization handler interface and the helpers every method shares.

A method is a *transform applied to a model* (gpt-fast's quant handlers): the model code
never branches on the method.  Each method has two halves:

* a ``QuantHandler`` (offline, in ``kiln build``): ``quantize_layer`` rewrites one decoder
  layer's linear layers in place from float32 weights (and calibration statistics when the
  method calibrates), leaving quantized buffers on the layer;
* a ``LinearMethod`` (online, in serving): ``create_weights`` replaces a layer's float
  ``weight`` with empty buffers of the quantized shapes so an engine's tensors load into
  them by name, and ``apply(layer, x)`` computes the layer's output (installed as
  ``layer.quant_method``; ``LinearBase.forward`` calls it).

``registry.convert_for_runtime(model, settings)`` does the second half for a whole model;
``registry.METHOD_TABLE`` names each method's two halves (this module imports none of them).
The quantized linears are every ``LinearBase`` inside the decoder layers (QKV, output,
gate-up and down projections); embeddings stay in the model dtype, and so does the LM head
unless ``QuantSettings.lm_head`` (int4 methods: ``QuantHandler.quantize_lm_head``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from ..model.layers import LinearBase

METHODS = ("none", "fp8", "int8-smoothquant", "int4-awq", "int4-gptq")
# GPTQ's "true sequential" order of a decoder layer's linears, one group each
TRUE_SEQUENTIAL = (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",))


class QuantizationError(ValueError):
    """A quantization setting the model cannot take (unknown method, a group size that does
    not divide a layer's input features, ...).  The message names the setting and the layer."""


@dataclass
class QuantSettings:
    """Settings of one quantization method (what ``kiln build`` flags carry).

    Fields:
        method: one of ``METHODS``.
        group_size: int4 columns per scale/zero group (32, 64 or 128).
        alpha: SmoothQuant migration strength in [0, 1].
        lm_head: the LM head is quantized too (int4 methods).
        extra: method-specific knobs recorded in the manifest (e.g. GPTQ damping).
    """

    method: str = "none"
    group_size: int = 128
    alpha: float = 0.5
    lm_head: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_manifest(self) -> dict[str, Any]:
        d: dict[str, Any] = {"method": self.method}
        if self.method.startswith("int4"):
            d["group_size"] = self.group_size
            d["format"] = "int4-packed-k8-asym"  # kiln.kernels.int4_format
            if self.lm_head:
                d["lm_head"] = True
        if self.method == "int8-smoothquant":
            d["alpha"] = self.alpha
        d.update(self.extra)
        return d

    @classmethod
    def from_manifest(cls, d: dict[str, Any]) -> "QuantSettings":
        return cls(method=d.get("method", "none"), group_size=int(d.get("group_size", 128)),
                   alpha=float(d.get("alpha", 0.5)), lm_head=d.get("lm_head") is True)


@dataclass
class LayerStats:
    """Calibration statistics of the inputs of one linear layer (collected by hooks).

    Fields:
        num_tokens: tokens seen.
        absmax: float32 [K] max |x| per input channel (SmoothQuant).
        absmean: float32 [K] mean |x| per input channel (AWQ).
        hessian: float32 [K, K] ``2/n * sum x x^T`` (GPTQ), or None when not requested.
        samples: float32 [S, K] a deterministic subsample of input rows (AWQ's loss), or None.
    """

    num_tokens: int = 0
    absmax: torch.Tensor | None = None
    absmean: torch.Tensor | None = None
    hessian: torch.Tensor | None = None
    samples: torch.Tensor | None = None


class LinearMethod:
    """Online half of a method: owns the quantized buffers of one linear layer."""

    name = "base"

    def create_weights(self, layer: LinearBase, name: str) -> None:  # pragma: no cover - interface
        """Replace ``layer.weight`` with empty quantized buffers (on the weight's device)."""
        raise NotImplementedError

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """``x`` [T, K] (model dtype) -> [T, N] (model dtype)."""
        raise NotImplementedError


class QuantHandler:
    """Offline half of a method.

    Attributes:
        needs_calibration: the method reads calibration statistics.
        wants: statistics it needs per linear ({"absmax", "absmean", "hessian", "samples"}).
        sequential_groups: when set, groups of linear names (inside a layer) that are calibrated
            and quantized one group after the other, each group's statistics collected with the
            earlier groups already quantized (GPTQ's "true sequential" option); ``quantize_layer``
            is then called once per group with only that group's statistics.
        prepare_wants: statistics ``prepare_layer`` reads (empty: it is not called).
    """

    needs_calibration = False
    wants: frozenset[str] = frozenset()
    sequential_groups: tuple[tuple[str, ...], ...] | None = None
    prepare_wants: frozenset[str] = frozenset()

    def __init__(self, settings: QuantSettings):
        self.settings = settings

    def check(self, model: nn.Module) -> None:
        """Raise ``QuantizationError`` when the model's shapes cannot take the settings."""

    def prepare_layer(self, layer: nn.Module, prefix: str, stats: dict[str, LayerStats]) -> None:
        """Exact float rewrites of one decoder layer before any of its linears is calibrated
        and quantized (e.g. smoothing folded into the norms), from the statistics named in
        ``prepare_wants``; the default does nothing."""

    def quantize_layer(self, layer: nn.Module, prefix: str, stats: dict[str, LayerStats] | None) -> None:
        """Quantize the linears of one decoder layer in place (float32 math).

        Args:
            layer: a ``LlamaDecoderLayer``.
            prefix: its name in the model (``model.layers.3``).
            stats: calibration statistics keyed by the linear's name inside the layer
                (``self_attn.qkv_proj``), or None for methods that do not calibrate.
        """
        raise NotImplementedError

    def linear_method(self) -> LinearMethod | None:
        """The online method this handler's output is served with (None: plain F.linear)."""
        return None

    def quantize_lm_head(self, model: nn.Module, stats: LayerStats) -> None:
        """Quantize the LM head in place from the statistics of its inputs (the final norm's
        outputs on the calibration text, the ``wants`` fields); called once after every
        decoder layer.  The LM head's weight may be tied to the embeddings: implementations
        must not write into it (they replace it, ``replace_weight``).

        Raises:
            QuantizationError: the method cannot quantize an LM head.
        """
        raise QuantizationError(f"{self.settings.method} cannot quantize the LM head")


def decoder_linears(layer: nn.Module) -> Iterator[tuple[str, LinearBase]]:
    """``(name, module)`` of every linear layer inside one decoder layer, in a fixed order."""
    for name, mod in layer.named_modules():
        if isinstance(mod, LinearBase):
            yield name, mod


def model_linears(model: nn.Module) -> Iterator[tuple[str, LinearBase]]:
    """``(full name, module)`` of every quantizable linear of a model (decoder layers only)."""
    for i, layer in enumerate(model.model.layers):
        for name, mod in decoder_linears(layer):
            yield f"model.layers.{i}.{name}", mod


def replace_weight(layer: LinearBase, buffers: dict[str, torch.Tensor]) -> None:
    """Drop ``layer.weight`` and register ``buffers`` (persistent, so they save and load)."""
    if "weight" in layer._parameters:
        del layer._parameters["weight"]
    for k, v in buffers.items():
        if k in layer._parameters:
            del layer._parameters[k]
        layer.register_buffer(k, v)


def check_group_size(model: nn.Module, group_size: int) -> None:
    """Every quantized linear's input features must be a multiple of ``group_size``.

    Raises:
        QuantizationError: naming the first layer that does not divide and the sizes that would.
    """
    for name, mod in model_linears(model):
        K = mod.in_features // mod.tp_size
        if K % group_size:
            ok = [g for g in (32, 64, 128) if K % g == 0 and all(
                (m.in_features // m.tp_size) % g == 0 for _, m in model_linears(model))]
            raise QuantizationError(
                f"group size {group_size} does not divide {name}'s {K} input features; "
                f"group sizes that fit this model: {ok or 'none'}")


def cached_dequant(layer, make) -> torch.Tensor:
    """A dequantized weight kept on the layer for the CPU path, rebuilt when any of the layer's
    own parameters or buffers (weight, scales, zero points, ...) changes: another tensor object
    (weak references, so a new buffer at a freed buffer's address is not taken for the old
    one) or an in-place write (version counters).

    Args:
        layer: the linear layer (``nn.Module``) that owns the quantized tensors.
        make: builds the dequantized weight (e.g. float [N, K] in the activations' dtype).
    Returns:
        what ``make`` returned, from the cache when nothing changed.
    """
    srcs = [t for t in list(layer._parameters.values()) + list(layer._buffers.values()) if t is not None]
    key = tuple((t._version, t.device) for t in srcs)
    hit = getattr(layer, "_kiln_dequant", None)
    if (hit is None or hit[1] != key or len(hit[0]) != len(srcs)
            or any(ref() is not t for ref, t in zip(hit[0], srcs))):
        hit = ([weakref.ref(t) for t in srcs], key, make())
        layer._kiln_dequant = hit
    return hit[2]


class NoQuantHandler(QuantHandler):
    """``none``: weights stay float (stored in the source's dtype)."""

    def quantize_layer(self, layer, prefix, stats) -> None:
        return None
