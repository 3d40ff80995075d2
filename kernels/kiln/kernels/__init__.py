"""Kiln's Triton kernels, each with a torch reference (``kiln.kernels.reference``).

Kernels (all take CUDA tensors; on the CPU they run only under ``TRITON_INTERPRET=1``,
which the tests use):

==========================  =============================  ===============================
kernel                      module                         reference
==========================  =============================  ===============================
``paged_attention``         ``attention``                  ``paged_attention_ref``
``reshape_and_cache``       ``cache``                      ``reshape_and_cache_ref``
``rotary_and_cache``        ``cache``                      rotary ref, then cache ref
``rms_norm``                ``norm``                       ``rms_norm_ref``
``fused_add_rms_norm``      ``norm``                       ``fused_add_rms_norm_ref``
``rotary_embedding``        ``rotary``                     ``rotary_embedding_ref``
``silu_and_mul``            ``activation``                 ``silu_and_mul_ref``
``gemv``                    ``gemv``                       ``gemv_ref``
``w4a16_gemm``              ``w4a16``                      ``w4a16_ref``
``per_token_quant_fp8``     ``fp8_quant``                  ``per_token_quant_fp8_ref``
``silu_and_mul_quant_fp8``  ``fp8_quant``                  ``silu_and_mul_quant_fp8_ref``
==========================  =============================  ===============================

``build_cos_sin_cache`` (reference module) builds the rotary table both use; the int4
packed weight format is ``int4_format``; launch choices are ``options.KernelOptions``
(per engine) and ``tuning`` (per device).  Importing this package imports neither Triton
nor a kernel: the names above are loaded on first use, so ``kiln.kernels.reference``,
``options`` and ``int4_format`` work where Triton is not installed.  It never imports
``kiln.runtime``.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "FP8_E4M3_MAX": "reference",
    "build_cos_sin_cache": "reference",
    "fused_add_rms_norm_ref": "reference",
    "paged_attention_ref": "reference",
    "reshape_and_cache_ref": "reference",
    "rms_norm_ref": "reference",
    "rotary_embedding_ref": "reference",
    "silu_and_mul_ref": "reference",
    "silu_and_mul": "activation",
    "paged_attention": "attention",
    "reshape_and_cache": "cache",
    "rotary_and_cache": "cache",
    "fused_add_rms_norm": "norm",
    "rms_norm": "norm",
    "rotary_embedding": "rotary",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    """Load ``name`` from its module on first access (PEP 562) and keep it here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kiln.kernels.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
