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
==========================  =============================  ===============================

``build_cos_sin_cache`` (reference module) builds the rotary table both use.  Importing
this package needs no GPU.  It never imports ``kiln.runtime``.
"""

import os as _os

if _os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # NumPy >= 2.4 vs Triton 3.6's interpreter
    from kiln.kernels.interp_compat import apply as _apply_interp_fix

    _apply_interp_fix()

from kiln.kernels.reference import (  # noqa: F401,E402
    FP8_E4M3_MAX,
    build_cos_sin_cache,
    fused_add_rms_norm_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
)
from kiln.kernels.activation import silu_and_mul  # noqa: F401
from kiln.kernels.attention import paged_attention  # noqa: F401
from kiln.kernels.cache import reshape_and_cache, rotary_and_cache  # noqa: F401
from kiln.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: F401
from kiln.kernels.rotary import rotary_embedding  # noqa: F401

__all__ = [
    "FP8_E4M3_MAX",
    "build_cos_sin_cache",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_and_cache",
    "rotary_embedding",
    "rotary_embedding_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]
