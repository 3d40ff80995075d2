"""Launch choices of the W4A16 GEMM: the measured table (data, ``kiln.kernels.tuning``,
``"w4a16"`` of each device's file) and the heuristics for problems it does not list.

A config is a dict: ``KERNEL`` (one of ``KERNELS``), ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``,
``SPLIT_K``, ``num_warps``, ``num_stages``, and per kernel ``CHAIN`` (gemv2: packed rows per
float16 chain), ``PREFETCH`` (gemv2, swap: load the next step before this step's math).
Measured numbers: docs/benchmarks.md, "W4A16".  No Triton import beyond ``triton.cdiv``.
"""

from __future__ import annotations

import torch
import triton

from kiln.kernels import tuning
from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions

__all__ = ["KERNELS", "DEQUANT_MIN_M", "TUNED", "m_bucket", "choose_config", "check_config"]

KERNELS = ("gemv", "gemv2", "mma", "swap", "dequant")

# From this M on (CUDA, no tuned entry), ``choose_config`` dequantizes the weight and runs
# cuBLAS (``dequant``) unless the engine's ``KernelOptions.w4a16_dequant_min_m`` says
# otherwise.  H200, Llama-3.1-8B projections: at M = 65 3.5x (qkv), 4.8x (o), 1.6x (gate_up),
# 5.0x (down) faster than the fused ``mma`` kernel, at 2048 6.3-6.5x (1.2x bf16 cuBLAS); at
# M = 64 it wins on qkv and o (1.32x, 1.16x) and loses on gate_up and down (0.95x, 0.94x), so
# ``mma`` keeps M <= 64.
DEQUANT_MIN_M = DEFAULT_OPTIONS.w4a16_dequant_min_m

# The default device table's entries: (N, K, M bucket) -> config (tests, benchmarks).
TUNED: dict[tuple[int, int, int], dict] = tuning.table().w4a16


def m_bucket(M: int) -> int:
    """The tuning bucket of M: 1, 2, 4 (M = 3, 4), 8 (5..8), 16 (9..16); 0 above 16."""
    return 1 if M <= 1 else 2 if M == 2 else 4 if M <= 4 else 8 if M <= 8 else 16 if M <= 16 else 0


def _split_for(K: int, tiles: int, bk: int, programs: int, min_steps: int = 4) -> int:
    """Power-of-two K split (<= 16) until ``tiles * split`` reaches ``programs``, keeping at
    least ``min_steps`` steps of ``bk`` per split."""
    split = 1
    while tiles * split < programs and K // (split * 2) >= min_steps * bk and split < 16:
        split *= 2
    return split


def _interpreter_config(kernel: str | None, M: int, K: int) -> dict:
    """Small tiles for a non-CUDA device (the CPU interpreter)."""
    bm = min(4, max(1, triton.next_power_of_2(M)))
    if kernel == "gemv2":
        return {"KERNEL": "gemv2", "BLOCK_M": bm, "BLOCK_N": 16, "BLOCK_K": 128, "CHAIN": 8,
                "SPLIT_K": 2 if K >= 512 else 1, "num_warps": 1, "num_stages": 1}
    return {"KERNEL": "gemv" if M <= 4 else "mma", "BLOCK_M": min(16, max(1, triton.next_power_of_2(M))),
            "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2 if K >= 512 else 1, "num_warps": 1, "num_stages": 1}


def choose_config(M: int, N: int, K: int, group_size: int, device: torch.device,
                  dtype: torch.dtype | None = None, kernel: str | None = None,
                  options: KernelOptions = DEFAULT_OPTIONS) -> dict:
    """Kernel, tile sizes, warps, stages and split-K for an ``[M, K] x [K, N]`` problem.

    The device's tuning table first (``tuning.table(device).w4a16``, CUDA only).  Then: M <= 2,
    a CUDA-core GEMV with enough K splits to fill the GPU (the packed-half ``gemv2`` for
    float16/bfloat16 x and groups of 32k: narrow 32-64 column tiles and 1024-wide K steps,
    about two programs per SM; else the float32 ``gemv``: 64 x 128 tiles, about four programs
    per SM); 2 < M <= 16 with float16/bfloat16 x and groups of 64k, the swap-AB tensor-core
    kernel (``swap``); M <= 64, the tensor-core ``mma`` kernel with a 16-64-row tile, same
    split rule; from ``options.w4a16_dequant_min_m`` (65) rows on CUDA, the weight
    dequantized to x's dtype and a cuBLAS GEMM (``dequant``; elsewhere larger M gets 128 x 128
    tiles without a split).  Under the CPU interpreter: small tiles.

    Args:
        dtype: x's dtype (None: float32 rules).
        kernel: "gemv" or "gemv2" forces that GEMV kernel for M <= 4 (benchmarks): the
            table's entry if it is that kernel, else that kernel's default; ``gemv2`` falls
            back to ``gemv`` where it does not apply (float32 x, G % 32 != 0).
    Raises:
        ValueError: ``kernel`` is neither None, "gemv" nor "gemv2".
    """
    if kernel not in (None, "gemv", "gemv2"):
        raise ValueError(f"the forced small-M W4A16 kernel must be gemv or gemv2, got {kernel!r}")
    half = dtype in (torch.float16, torch.bfloat16)
    gemv2_ok = half and group_size % 32 == 0 and M <= 4
    if kernel == "gemv2" and not gemv2_ok:
        kernel = "gemv"
    if M > 4:
        kernel = None
    tuned = tuning.table(device).w4a16.get((N, K, m_bucket(M))) if device.type == "cuda" else None
    if tuned is not None and tuned["KERNEL"] == "gemv2" and not gemv2_ok:
        tuned = None  # measured for float16/bfloat16 x and groups of 32k only
    if tuned is not None and tuned["KERNEL"] == "swap" and not (half and group_size % tuned["BLOCK_K"] == 0):
        tuned = None  # the swap kernel needs float16/bfloat16 x and whole groups per step
    if tuned is not None and kernel in (None, tuned["KERNEL"]):
        return dict(tuned)
    if kernel is None and M >= options.w4a16_dequant_min_m and device.type == "cuda":
        return {"KERNEL": "dequant", "BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 8,
                "num_stages": 1}  # compute-bound: cuBLAS on a dequantized copy
    if kernel is None and M <= 2:
        kernel = "gemv2" if gemv2_ok else "gemv"
    if device.type != "cuda":
        return _interpreter_config(kernel, M, K)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bk = 128 if group_size % 128 == 0 else 64
    if kernel == "gemv2":  # H200 winners: narrow column tiles, long K steps, ~2 programs per SM
        bn, bk2, warps = (64, 1024, 8) if M == 1 else (32, 1024, 4)
        bk2 = min(bk2, max(256, triton.next_power_of_2(K) // 4))
        return {"KERNEL": "gemv2", "BLOCK_M": min(4, max(1, triton.next_power_of_2(M))), "BLOCK_N": bn,
                "BLOCK_K": bk2, "CHAIN": 8, "SPLIT_K": _split_for(K, triton.cdiv(N, bn), bk2, 2 * sms, 1),
                "num_warps": warps, "num_stages": 1}
    if kernel == "gemv":  # H200: the GEMV kernel wins at M = 1, 2, the tensor-core one from M = 4
        return {"KERNEL": "gemv", "BLOCK_M": triton.next_power_of_2(M), "BLOCK_N": 64, "BLOCK_K": bk,
                "SPLIT_K": _split_for(K, triton.cdiv(N, 64), bk, 4 * sms), "num_warps": 4, "num_stages": 2}
    if 2 < M <= 16 and half and group_size % 64 == 0:  # H200: the swap kernel wins from M = 4
        return {"KERNEL": "swap", "BLOCK_M": 8 if M <= 8 else 16, "BLOCK_N": 128, "BLOCK_K": bk, "PREFETCH": 1,
                "SPLIT_K": _split_for(K, triton.cdiv(N, 128), bk, 4 * sms), "num_warps": 4, "num_stages": 3}
    if M <= 64:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        return {"KERNEL": "mma", "BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 128,
                "SPLIT_K": _split_for(K, triton.cdiv(N, 128) * triton.cdiv(M, bm), bk, 4 * sms), "num_warps": 4,
                "num_stages": 2}
    return {"KERNEL": "mma", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8,
            "num_stages": 3}


def check_config(cfg: dict) -> None:
    """ValueError unless ``cfg`` names a kernel and has the launch keys it needs: power-of-two
    tile sizes, ``SPLIT_K`` / ``num_stages`` >= 1, 1-16 warps."""
    if cfg.get("KERNEL") not in KERNELS:
        raise ValueError(f"config KERNEL must be one of {', '.join(KERNELS)}, got {cfg.get('KERNEL')!r}")
    need = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"]
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"config for the {cfg['KERNEL']} kernel lacks {', '.join(missing)}")
    bad = [k for k in need if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1]
    bad += [k for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")
            if k not in bad and (cfg[k] & (cfg[k] - 1) or (k == "num_warps" and cfg[k] > 16))]
    if bad:
        raise ValueError("config " + ", ".join(f"{k}={cfg[k]!r}" for k in bad) + ": tile sizes and num_warps must "
                         "be powers of two (num_warps <= 16), SPLIT_K and num_stages integers >= 1")
