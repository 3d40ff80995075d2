"""W4A16 GEMM: ``y = x @ W^T`` with ``W`` stored as packed int4 (``kiln.kernels.int4_format``)
and ``x`` in float16/bfloat16 (float32 too, for tests), dequantized in registers.

This package holds one kernel per module and this launcher, which checks the arguments, picks
a launch config (``config.choose_config``: the device's tuning table, then heuristics) and
launches:

* ``gemv`` (small M, no tensor cores, any x dtype): float32 FMAs per nibble; about 3
  instructions per weight.  Dequantization: nibble ``i`` is shifted to mantissa bits 19..22
  and OR-ed into ``1.0f``: one shift and one AND/OR per weight give ``f = 1 + q / 16``
  exactly; within one group ``sum_k (q - z) s x = 16 s sum f x - (16 + z) s sum x``, so the
  scale and zero point are applied once per group and column to the partial sums.
* ``gemv2`` (M <= 4, float16/bfloat16 x, G % 32 == 0): packed half math, two weights per
  instruction.  The trick of FasterTransformer's ``interleaved_numeric_conversion.h``, Marlin
  (Frantar et al., 2024, ``dequant``) and LMDeploy's ``lop3``-based int4 converters
  (re-derived here, no code taken): one LOP3 of a packed word with ``0x000F000F`` (or
  ``0x00F000F0``) and ``0x64006400`` gives the f16x2 pair ``(1024 + q_t, 1024 + q_{t+4})`` (or
  ``1024 + 16 q``) for nibbles t and t + 4; one ``fma.rn.f16x2`` with 1/16 (1/256) and the
  per-group word ``-(1024 + z) / 16`` (``-(64 + z) / 16``, built from z with integer ops)
  gives ``(q - z) / 16`` exactly, so the offset and the zero point cost nothing extra (for
  G = 32 the two lanes are in different groups: each lane gets its own z and scale).  x is
  read as int64 words and paired to the same lane order (PRMT for float16; bfloat16 is
  widened and rounded to float16 with ``cvt.rn.f16x2.f32``, once per step and thread, reused
  over the thread's columns).  Then one HFMA2 per two weights and row of x into a float16
  chain of at most 32 products per lane (one 64-column block, ``CHAIN`` = 8 packed rows; 4
  halves it), converted and added, times the group's scale, into float32.  Offline sm_90 SASS
  of the loop (bf16 x, M = 1): 2.2 instructions per weight at BLOCK_N = 256, 2.0 at 512,
  against 5.3 for ``gemv``.  Precision: weights ``(q - z)/16`` are exact, products and the
  32-long chains are rounded to float16 (relative error ~1e-3 against the float32 reference,
  the size of bfloat16's own output rounding); x is converted to float16, so |x| and a
  block's partial sum must stay below 65504 (float32 x is rounded to float16).  bfloat16 math
  for bf16 x would keep 8 mantissa bits in the chain (~1 % error after 32 terms).  H200 launch
  choice: narrow tiles (32-64 columns x 512-2048 K per step) win at M = 1, 2 on all four
  Llama-3.1-8B projections; ``PREFETCH`` 1 (the next step's loads before this step's math)
  wins where Nsight Compute showed half the stall cycles waiting on global loads.  With
  ``silu_and_mul`` on a gate|up weight its epilogue stores ``silu(gate) * up`` (``GATED``): no
  SiLU-and-mul kernel and no ``[M, 2I]`` round trip (H200, batch-1 int4 decode of the 8B
  shape: 2.073 ms of GPU per step vs 2.082 unfused).
* ``mma`` (larger M): eight ``tl.dot`` of depth ``BLOCK_K / 8`` per step on the same ``f``
  values (exact in bf16/fp16), group correction on the fp32 dot result.
* ``swap`` (M <= 16, float16/bfloat16 x, ``G % BLOCK_K == 0``): the weight as the A operand
  of the tensor cores, two codes per LOP3.  H200: the fastest kernel at M = 4..16, 1.4-1.5x
  ``mma`` at M = 8 and 1.1-1.25x ``gemv2`` at M = 4; exact to ~1e-4.
* ``dequant`` (CUDA default from ``KernelOptions.w4a16_dequant_min_m`` rows): the weight
  dequantized to x's dtype, then a dense GEMM (cuBLAS).

The GEMV and tensor-core kernels split K over ``SPLIT_K`` programs for small M (N / BLOCK_N
tiles alone do not fill 132 SMs), reduced in the same launch (``kiln.kernels.splitk``:
partials added in split order by the last program of a tile).  On Hopper every kernel is
launched with programmatic dependent launch when the engine's options allow
(``kiln.kernels.pdl``): it waits for its predecessor before its first load, and all its
writes (partials, counters, ``y``) come after that.  Measured numbers: docs/benchmarks.md,
"W4A16".  ``w4a16_ref`` (``kiln.kernels.reference``) is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import activation
from kiln.kernels.int4_format import KBLOCK
from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.pdl import launch_kwargs
from kiln.kernels.platform import interpreting
from kiln.kernels.reference import dequantize_ref, w4a16_ref
from kiln.kernels.splitk import counters as _counters
from kiln.kernels.w4a16.config import DEQUANT_MIN_M, KERNELS, TUNED, check_config, choose_config, m_bucket
from kiln.kernels.w4a16.dequant import dequantize
from kiln.kernels.w4a16.gemv import _gemv_kernel
from kiln.kernels.w4a16.gemv2 import _gemv2_kernel
from kiln.kernels.w4a16.mma import _mma_kernel
from kiln.kernels.w4a16.swap import _swap_kernel

__all__ = ["w4a16_gemm", "w4a16_ref", "dequantize_ref", "choose_config", "m_bucket", "TUNED", "KBLOCK", "KERNELS",
           "DEQUANT_MIN_M"]

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _use_asm(x: torch.Tensor) -> bool:
    """Inline PTX on a real GPU (not under the CPU interpreter)."""
    return x.is_cuda and not interpreting()


def _gemv2_x(x: torch.Tensor) -> torch.Tensor:
    """x as int64 words [M, K / 4] (four float16/bfloat16; a view, no copy, for row-major x).
    float32 x (tests) is rounded to float16 first; other layouts are copied."""
    if x.dtype == torch.float32:
        x = x.to(torch.float16)
    if x.stride(1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8:
        x = x.contiguous()
    return x.view(torch.int64)


def _check_args(x, qweight, scales, qzeros, out_dtype) -> tuple[int, int, int, int]:
    """``(M, N, K, G)`` of a call; ValueError for shapes or dtypes outside the format."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if qweight.dim() != 2 or scales.dim() != 2 or qzeros.dim() != 2:
        raise ValueError(f"qweight, scales and qzeros must be 2-D, got {tuple(qweight.shape)}, "
                         f"{tuple(scales.shape)}, {tuple(qzeros.shape)}")
    M, K = x.shape
    K8, N = qweight.shape
    if K == 0 or N == 0:
        raise ValueError(f"empty weight: K={K}, N={N}")
    if not scales.dtype.is_floating_point or scales.dtype.itemsize > 4 or qzeros.dtype != torch.uint8:
        raise ValueError(f"scales must be float16/bfloat16/float32 and qzeros uint8, got {scales.dtype} / "
                         f"{qzeros.dtype}")
    if qweight.dtype != torch.int32 or K8 * 8 != K or K % KBLOCK:
        raise ValueError(f"qweight must be int32 [K/8={K // 8}, N] with K % {KBLOCK} == 0, "
                         f"got {qweight.dtype} {tuple(qweight.shape)} for K={K}")
    if scales.shape != qzeros.shape or scales.shape[1] != N or K % scales.shape[0]:
        raise ValueError(f"scales/qzeros must be [K/G, N={N}], got {tuple(scales.shape)} / {tuple(qzeros.shape)}")
    if x.dtype not in _TL:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if out_dtype not in _TL:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    G = K // scales.shape[0]
    if G % 8:
        raise ValueError(f"group size {G} must be a multiple of 8")
    return M, N, K, G


def _check_kernel_fit(cfg: dict, x: torch.Tensor, G: int) -> None:
    """ValueError when the config's kernel cannot take this problem."""
    bk = cfg["BLOCK_K"]
    if bk % KBLOCK or (cfg["KERNEL"] == "mma" and bk < 128):
        raise ValueError(f"BLOCK_K {bk} must be a multiple of {KBLOCK} (and >= 128 for the mma kernel)")
    if cfg["KERNEL"] == "gemv2" and (G % 32 or cfg["BLOCK_M"] > 4):
        raise ValueError(f"the {cfg['KERNEL']} kernel needs G % 32 == 0 and BLOCK_M <= 4, got G={G}, "
                         f"BLOCK_M={cfg['BLOCK_M']}")
    if cfg["KERNEL"] == "swap" and (G % bk or x.dtype == torch.float32 or cfg["BLOCK_M"] < 8):
        raise ValueError(f"the swap kernel needs float16/bfloat16 x, G % BLOCK_K == 0 and BLOCK_M >= 8, got "
                         f"{x.dtype}, G={G}, BLOCK_K={bk}, BLOCK_M={cfg['BLOCK_M']}")


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               config: dict | None = None, out_dtype: torch.dtype | None = None,
               silu_and_mul: bool = False, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``x`` [M, K] (float16/bfloat16/float32) times the int4 weight -> [M, N] in ``out_dtype``.

    With ``silu_and_mul`` the weight is a fused gate|up projection ``[2I, K]`` and the result
    is ``silu(y[:, :I]) * y[:, I:]``, ``[M, I]`` (SwiGLU, as ``kiln.kernels.activation``): in
    the ``gemv2`` kernel's epilogue, from its float32 sums, when the launch is ``gemv2`` without
    a K split (the decode GEMVs at M = 1, 2), else the GEMM then
    ``activation.silu_and_mul``.  The fused form saves the SiLU kernel, its launch and the
    ``[M, 2I]`` round trip, and rounds once (the unfused form rounds y to ``out_dtype`` first).

    Args:
        x: activations, any 2-D strides.
        qweight: int32 [K // 8, N]; scales: float [K // G, N]; qzeros: uint8 [K // G, N]; any
            strides.
        config: override ``choose_config``'s launch choice (benchmarks, tests).
        options: the engine's kernel options (programmatic dependent launch, the row count
            from which the weight is dequantized for cuBLAS).
        out_dtype: float16, bfloat16 or float32 (default ``x.dtype``); the kernels round their
            float32 accumulators to it when they store (float32: logits of a quantized LM head).
    Raises:
        ValueError: shapes or dtypes that do not fit the format, a bad ``out_dtype``, or a
            ``config`` that names no kernel, lacks launch keys or has tiles that are not powers
            of two; ``silu_and_mul`` with an odd N.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    M, N, K, G = _check_args(x, qweight, scales, qzeros, out_dtype)
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    cfg = dict(config or choose_config(M, N, K, G, x.device, x.dtype, options=options))
    check_config(cfg)
    _check_kernel_fit(cfg, x, G)
    bk = cfg["BLOCK_K"]
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(K, bk)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    gated = False
    if silu_and_mul:
        if N % 2:
            raise ValueError(f"silu_and_mul needs a gate|up weight with an even N, got N={N}")
        if not (cfg["KERNEL"] == "gemv2" and split == 1 and cfg["BLOCK_N"] >= 4):
            return activation.silu_and_mul(w4a16_gemm(x, qweight, scales, qzeros, cfg, out_dtype, options=options),
                                 options=options)
        gated = True  # the gemv2 epilogue writes silu(gate) * up: N // 2 columns, BLOCK_N // 2 per tile
    n_out = N // 2 if gated else N
    tile_n = cfg["BLOCK_N"] // 2 if gated else cfg["BLOCK_N"]
    grid = (triton.cdiv(n_out, tile_n), triton.cdiv(M, cfg["BLOCK_M"]), split)
    out = torch.empty((M, n_out), dtype=out_dtype, device=x.device)
    if split > 1:
        part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, grid[0] * grid[1])
    else:
        part = cnt = out
    if cfg["KERNEL"] == "gemv2":
        xw = _gemv2_x(x)
        _gemv2_kernel[grid](xw, qweight, scales, qzeros, out, part, cnt, M, n_out, K, k_per_split, split,
                            xw.stride(0), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
                            qzeros.stride(0), qzeros.stride(1), out.stride(0), out.stride(1),
                            GROUP_SIZE=G, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
                            CHAIN=cfg.get("CHAIN", 8), HAS_SPLIT=split > 1, NUM_STAGES=cfg["num_stages"],
                            X_BF16=x.dtype == torch.bfloat16, ASM=_use_asm(x), EVEN_K=K % bk == 0,
                            EVEN_N=n_out % tile_n == 0, EVEN_M=M % cfg["BLOCK_M"] == 0,
                            PREFETCH=cfg.get("PREFETCH", 0), GATED=gated,
                            num_warps=cfg["num_warps"], **launch_kwargs(x.device, options))
        return out
    if cfg["KERNEL"] == "dequant":  # large M: dequantize once, then a dense GEMM (cuBLAS on CUDA)
        w = dequantize(qweight, scales, qzeros, x.dtype, cfg["BLOCK_N"], bk, cfg["num_warps"], options)
        if out_dtype != x.dtype:
            return torch.matmul(x, w.t()).to(out_dtype)
        return torch.matmul(x, w.t(), out=out)
    args = (x, qweight, scales, qzeros, out, part, cnt, M, N, K, k_per_split, split,
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
            qzeros.stride(0), qzeros.stride(1), out.stride(0), out.stride(1))
    meta = dict(GROUP_SIZE=G, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, HAS_SPLIT=split > 1,
                NUM_STAGES=cfg["num_stages"], ASM=_use_asm(x), num_warps=cfg["num_warps"])
    if cfg["KERNEL"] == "swap":
        _swap_kernel[grid](*args, **meta, X_F16=x.dtype == torch.float16, EVEN_N=N % cfg["BLOCK_N"] == 0,
                           PREFETCH=cfg.get("PREFETCH", 0))  # launched without PDL, as measured
    elif cfg["KERNEL"] == "gemv":
        _gemv_kernel[grid](*args, **meta, **launch_kwargs(x.device, options))
    else:
        _mma_kernel[grid](*args, **meta, DOT_DTYPE=_TL[x.dtype],
                          DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", **launch_kwargs(x.device, options))
    return out
