"""Post-training quantization for ``kiln build``: each method is a transform applied to the
model (gpt-fast's quant handlers), with an offline half (``QuantHandler``) and a serving half
(``LinearMethod`` installed as ``LinearBase.quant_method``), named in ``registry.METHOD_TABLE``.

=====================  =============================================  ==================
method                 algorithm                                      module
=====================  =============================================  ==================
``fp8``                W8A8 FP8 E4M3, per-channel / per-token         ``fp8``
``int8-smoothquant``   SmoothQuant (Xiao et al., 2023), W8A8 INT8     ``smoothquant``
``int4-awq``           AWQ (Lin et al., 2024), W4A16                  ``awq``
``int4-gptq``          GPTQ (Frantar et al., 2023), W4A16             ``gptq``
KV cache ``fp8``       calibrated per-layer scales                    ``kv_fp8``
=====================  =============================================  ==================

``rtn.quantize_model_rtn`` quantizes a model in place without calibration (random-weight
models of benchmarks and tests).
"""

from .base import METHODS, QuantizationError, QuantSettings  # noqa: F401
from .registry import convert_for_runtime, get_handler  # noqa: F401
