"""The kernel choices of one engine, as one typed, immutable object.

``KernelOptions`` is chosen once, when an engine starts (``kiln.runtime.config.EngineArgs``,
i.e. the ``kiln serve`` / ``kiln bench`` flags), and passed down: model runner -> model
layers, attention backend and linear methods -> the launchers in ``kiln.kernels``.  Nothing
below that reads the environment.  Plain Python (no torch, no Triton), so the runtime can
build it on machines without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KernelOptions", "DEFAULT_OPTIONS"]


@dataclass(frozen=True)
class KernelOptions:
    """Kernel choices that are not fixed by the problem shape.

    Fields:
        pdl: launch kernels with programmatic dependent launch where the device supports it
            (compute capability >= 9.0, not the CPU interpreter; ``kiln.kernels.pdl``).  Off:
            ordinary launches (A/B runs, profiles, where a PDL kernel's recorded time includes
            its wait for the predecessor).
        fused_rope_kv: the runtime rotates q and k and writes the KV cache in one kernel
            (``kiln.kernels.cache.rotary_and_cache``) instead of the rotary kernel then
            ``reshape_and_cache``.
        w4a16_dequant_min_m: from this many rows (tokens) on, a CUDA W4A16 GEMM without a
            tuned entry dequantizes the weight and runs cuBLAS (``kiln.kernels.w4a16``); below,
            the fused int4 kernels.  An integer >= 1.

    Raises:
        ValueError: a field of the wrong type or out of range (at construction).
    """

    pdl: bool = True
    fused_rope_kv: bool = True
    w4a16_dequant_min_m: int = 65

    def __post_init__(self) -> None:
        for name in ("pdl", "fused_rope_kv"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelOptions.{name} must be a bool, got {getattr(self, name)!r}")
        m = self.w4a16_dequant_min_m
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"KernelOptions.w4a16_dequant_min_m must be an integer >= 1 (rows from which int4 "
                             f"GEMMs dequantize and use cuBLAS), got {m!r}")


DEFAULT_OPTIONS = KernelOptions()
