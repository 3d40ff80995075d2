"""The quantization methods, by name: an explicit table of each method's offline handler and
serving linear method, and the two entry points that use it.

``METHOD_TABLE`` is the one place that imports every method module; the modules themselves
import only ``base`` (and ``int4`` / ``gptq`` / ``smoothquant`` helpers), so there is no import
cycle.  ``kiln build`` calls ``get_handler``; loading an engine calls ``convert_for_runtime``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .awq import AwqHandler
from .base import METHODS, LinearMethod, NoQuantHandler, QuantHandler, QuantizationError, QuantSettings, model_linears
from .fp8 import Fp8Handler, Fp8LinearMethod
from .gptq import GptqHandler
from .int4 import Int4LinearMethod
from .smoothquant import RUNTIME_SMOOTHED, Int8LinearMethod, SmoothQuantHandler

__all__ = ["Method", "METHOD_TABLE", "CHECKPOINT_METHOD_TABLE", "get_handler", "convert_for_runtime"]


@dataclass(frozen=True)
class Method:
    """One quantization method's two halves."""

    # settings -> the offline handler (``kiln build``)
    handler: Callable[[QuantSettings], QuantHandler]
    # (settings, linear's name in the model, e.g. ``model.layers.3.self_attn.o_proj`` or
    # ``lm_head``) -> the serving method of that linear (None: plain F.linear)
    linear: Callable[[QuantSettings, str], LinearMethod | None]


METHOD_TABLE: dict[str, Method] = {
    "fp8": Method(Fp8Handler, lambda settings, name: Fp8LinearMethod()),
    "int8-smoothquant": Method(SmoothQuantHandler, lambda settings, name: Int8LinearMethod(
        runtime_smooth=name.rsplit(".", 1)[-1] in RUNTIME_SMOOTHED)),
    "int4-awq": Method(AwqHandler, lambda settings, name: Int4LinearMethod(settings.group_size)),
    "int4-gptq": Method(GptqHandler, lambda settings, name: Int4LinearMethod(settings.group_size)),
}
if set(METHOD_TABLE) != set(METHODS) - {"none"}:  # pragma: no cover - a table edited without METHODS
    raise RuntimeError("quantization METHODS and METHOD_TABLE disagree")


def _no_handler(settings: QuantSettings) -> QuantHandler:
    raise QuantizationError(f"{settings.method} is the serving format of pre-quantized checkpoints "
                            f"(kiln build --quantization auto); Kiln does not quantize into it")


# Serving formats of pre-quantized checkpoints (``checkpoint``): the weights arrive quantized,
# so there is no offline handler.  ``int8``: W8A8 INT8 without runtime smoothing vectors, the
# activations on compressed-tensors' symmetric grid (``quantize_rows_int8(full_range=True)``);
# ``int4``: the packed W4A16 format of int4-awq / int4-gptq engines.  Checkpoints in FP8 W8A8
# are served by ``fp8`` itself.
CHECKPOINT_METHOD_TABLE: dict[str, Method] = {
    "int8": Method(_no_handler, lambda settings, name: Int8LinearMethod(runtime_smooth=False, full_range=True)),
    "int4": Method(_no_handler, lambda settings, name: Int4LinearMethod(settings.group_size)),
}


def _method(name: str) -> Method:
    if name in CHECKPOINT_METHOD_TABLE:
        return CHECKPOINT_METHOD_TABLE[name]
    if name not in METHOD_TABLE:
        raise QuantizationError(f"unknown quantization method {name!r}; choose one of {', '.join(METHODS)}")
    return METHOD_TABLE[name]


def get_handler(settings: QuantSettings) -> QuantHandler:
    """The offline handler for ``settings.method``.

    Raises:
        QuantizationError: unknown method.
    """
    if settings.method == "none":
        return NoQuantHandler(settings)
    return _method(settings.method).handler(settings)


def convert_for_runtime(model: nn.Module, settings: QuantSettings) -> None:
    """Prepare a freshly built model to receive a quantized engine's tensors: every decoder
    linear gets empty quantized buffers and its ``quant_method``.  No-op for ``none``.

    Raises:
        QuantizationError: unknown method, or an LM head the method cannot quantize.
    """
    if settings.method == "none":
        return
    linear = _method(settings.method).linear
    for name, mod in model_linears(model):
        lm = linear(settings, name)
        if lm is not None:
            lm.create_weights(mod, name)
            mod.quant_method = lm
    if settings.lm_head:
        lm = linear(settings, "lm_head")
        if lm is None:
            raise QuantizationError(f"{settings.method} has no quantized LM head")
        lm.create_weights(model.lm_head, "lm_head")  # replaces the (maybe tied) weight on the head only
        model.lm_head.quant_method = lm
