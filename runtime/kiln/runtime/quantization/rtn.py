"""Round-to-nearest quantization of a whole model in place, without calibration.

For models with random weights (``--load-format dummy``: benchmarks, kernel warm-up tests),
where calibration statistics mean nothing and only the speed of the quantized path matters.
"""

from __future__ import annotations

import torch
from torch import nn

from . import int4
from .base import QuantizationError, QuantSettings, decoder_linears
from .fp8 import Fp8Handler

__all__ = ["quantize_model_rtn"]


def quantize_model_rtn(model: nn.Module, method: str, group_size: int = 128, lm_head: bool = False) -> None:
    """Quantize every decoder linear of ``model`` (a ``LlamaForCausalLM``) in place.

    Args:
        method: "int4" (min/max groups, the W4A16 format) or "fp8" (per-channel scales).
        group_size: int4 columns per group.
        lm_head: int4 only: the LM head too, as ``kiln build --quantize-lm-head`` does.
    Raises:
        QuantizationError: another method, or ``lm_head`` with fp8.
    """
    if method not in ("int4", "fp8") or (lm_head and method != "int4"):
        raise QuantizationError(f"round-to-nearest quantization takes int4 (with or without the LM head) or fp8, "
                                f"got {method!r} (lm_head={lm_head})")
    for layer in model.model.layers:
        if method == "fp8":
            Fp8Handler(QuantSettings(method="fp8", extra={"fp8_weights": "rtn"})).quantize_layer(layer, "", None)
            continue
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
