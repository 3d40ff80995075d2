"""Round-to-nearest quantization of a whole model in place, without calibration.

For models with random weights (``--load-format dummy``: ``kiln bench offline --quantization``,
kernel warm-up tests), where calibration statistics mean nothing and only the speed of the
quantized path matters.  Each method leaves the layers in exactly the serving format a
``kiln build`` engine of that method loads into (``registry.convert_for_runtime``), so the
same kernels run:

* ``fp8``: per-channel E4M3 weights, ``max|w| / 448`` scales (``Fp8Handler``'s "rtn" weights);
* ``int8-smoothquant``: per-channel INT8 weights, ``max|w| / 127``; the output projection keeps
  its run-time smoothing vector (all ones: no statistics to smooth by), as a built engine does;
* ``int4-awq`` / ``int4-gptq`` (and ``int4``): min/max int4 groups in the W4A16 format; the two
  methods differ only in how a calibrated build chooses the codes, so both run the same kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from . import int4
from .base import QuantizationError, QuantSettings, check_group_size, decoder_linears, replace_weight
from .fp8 import Fp8Handler
from .smoothquant import RUNTIME_SMOOTHED, Int8LinearMethod, quantize_rows_int8

__all__ = ["RTN_METHODS", "quantize_model_rtn"]

RTN_METHODS = ("fp8", "int8-smoothquant", "int4-awq", "int4-gptq", "int4")


def quantize_model_rtn(model: nn.Module, method: str, group_size: int = 128, lm_head: bool = False) -> None:
    """Quantize every decoder linear of ``model`` (a ``LlamaForCausalLM``) in place.

    Args:
        method: one of ``RTN_METHODS`` (``int4`` is ``int4-awq``'s format).
        group_size: int4 columns per group.
        lm_head: int4 only: the LM head too, as ``kiln build --quantize-lm-head`` does.
    Raises:
        QuantizationError: another method, ``lm_head`` with a method other than int4, or a
            group size that does not divide a linear's input features.
    """
    is_int4 = method.startswith("int4")
    if method not in RTN_METHODS or (lm_head and not is_int4):
        raise QuantizationError(f"round-to-nearest quantization takes {', '.join(RTN_METHODS)} (the LM head "
                                f"with int4 only), got {method!r} (lm_head={lm_head})")
    if is_int4:
        check_group_size(model, group_size)
    for layer in model.model.layers:
        if method == "fp8":
            Fp8Handler(QuantSettings(method="fp8", extra={"fp8_weights": "rtn"})).quantize_layer(layer, "", None)
        elif method == "int8-smoothquant":
            for name, mod in decoder_linears(layer):
                _store_rtn_int8(mod, runtime_smooth=name.rsplit(".", 1)[-1] in RUNTIME_SMOOTHED)
        else:
            for _, mod in decoder_linears(layer):
                _store_rtn_int4(mod, group_size)
    if lm_head:
        _store_rtn_int4(model.lm_head, group_size)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _store_rtn_int4(mod: nn.Module, group_size: int) -> None:
    """Replace ``mod.weight`` by its min/max int4 quantization (``int4.store_int4``)."""
    w = mod.weight.data.float()
    s, z = int4.quantize_params(w, group_size)
    int4.store_int4(mod, int4.quantize_with(w, s, z, group_size), s, z, group_size)


def _store_rtn_int8(mod: nn.Module, runtime_smooth: bool) -> None:
    """Replace ``mod.weight`` by per-channel INT8 (``smoothquant``'s format), with a smoothing
    vector of ones [K] when the layer smooths at run time."""
    with torch.no_grad():
        q, scale = quantize_rows_int8(mod.weight.data)
        bufs = {"weight": q, "weight_scale": scale.view(-1)}
        if runtime_smooth:
            bufs["smooth_inv"] = torch.ones(q.shape[1], dtype=torch.float32, device=q.device)
        replace_weight(mod, bufs)
    mod.quant_method = Int8LinearMethod(runtime_smooth=runtime_smooth)
