"""Dense GEMV for small M: ``y[M, N] = x[M, K] @ W[N, K]^T`` with ``W`` in nn.Linear layout (row-major,
K contiguous), float16/bfloat16 (float32 too, for tests), float32 accumulation.

Batch-1 decode spends most of its step in four weight GEMMs at M = 1 (Llama-3.1-8B: qkv, o,
gate_up, down), where cuBLAS reaches 2.5-3.8 TB/s on an H200 (docs/benchmarks.md).  At M <= 8
the problem is a weight stream: no tensor cores, each program owns ``BLOCK_N`` rows of ``W``
and walks K in ``BLOCK_K``-wide contiguous chunks (one 16-byte load per thread and row),
multiply-adding into a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` float32 accumulator that is reduced
over K once, after the loop.  Weights are loaded ``evict_first`` (read once; x stays in L2).
``BLOCK_K`` is a multiple of ``256 * num_warps`` (16-bit types: eight elements, one 16-byte
vector, per thread and row): then Triton gives the weight tile and the x tile the same layout
(8 per thread, the warp's 32 threads and all warps along K) and the loop has no layout
conversion; a narrower chunk makes it shuffle every weight tile through shared memory (offline
sm_90 compile: one ``convert_layout`` in the loop).  ``BLOCK_M * BLOCK_N * BLOCK_K / (256 *
num_warps) <= 16`` keeps the accumulator in registers (<= 128 per thread, no spills).

Rows past N and M are clamped to the last row (always in bounds, so the weight loads need no
mask when ``K % BLOCK_K == 0``) and dropped at the store.  Where N / BLOCK_N programs do not
fill the GPU, ``SPLIT_K`` programs share a row block; the reduction is in the same launch (the
step runs inside a CUDA graph, where every launch costs microseconds): each split writes its
float32 partial, bumps a per-tile counter, and the last to arrive adds the partials (in split
order, so results are bit-reproducible), writes ``y`` and resets the counter (as in ``w4a16``).

Launch choices: ``TUNED`` (measured per (N, K, M bucket)), else ``choose_config``'s default.
``reference.gemv_ref`` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import tuning
from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.pdl import launch_kwargs, pdl_start
from kiln.kernels.reference import gemv_ref
from kiln.kernels.splitk import counters as _counters
from kiln.kernels.splitk import finish_tile

__all__ = ["gemv", "gemv_ref", "choose_config", "use_gemv", "m_bucket", "TUNED", "MAX_M"]

MAX_M = 8  # largest M the kernel is meant for (larger M: a tensor-core GEMM)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_xm, stride_wn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = tl.minimum(offs_m, M - 1)  # clamped: loads in bounds, extra rows dropped at the store
    rows_n = tl.minimum(offs_n, N - 1)
    k3 = offs_k[None, None, :]
    w_ptrs = w_ptr + rows_n[None, :, None].to(tl.int64) * stride_wn + k3  # [1, BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows_m[:, None, None] * stride_xm + k3  # [BLOCK_M, 1, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            x = tl.load(x_ptrs + k0, eviction_policy="evict_last")
        else:
            mk = k0 + k3 < k_hi
            w = tl.load(w_ptrs + k0, mask=mk, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs + k0, mask=mk, other=0.0, eviction_policy="evict_last")
        acc += w.to(tl.float32) * x.to(tl.float32)
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    finish_tile(y, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
                pid_m * tl.num_programs(0) + pid_n, SPLIT_K, HAS_SPLIT)


# Measured launch configs: (N, K, M bucket) -> config; buckets 1, 2, 4, 8 (M = 3 uses 4's,
# 5..8 use 8's); the device's tuning table, ``"gemv"`` (data: ``kiln.kernels.tuning``; H200
# sweep of 43-127 configs per point with ``benchmarks/gemv_bench.py``, docs/benchmarks.md,
# "bf16 GEMV (batch-1 decode)").  Only points where the kernel beat cuBLAS are listed, and
# ``use_gemv`` routes a linear layer here only for those.  ``TUNED`` is the default table's.
TUNED: dict[tuple[int, int, int], dict] = tuning.table().gemv

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def m_bucket(M: int) -> int:
    """The ``TUNED`` bucket of M (0 above ``MAX_M``)."""
    return 1 if M <= 1 else 2 if M == 2 else 4 if M <= 4 else 8 if M <= 8 else 0


def choose_config(M: int, N: int, K: int, device: torch.device) -> dict:
    """Tile sizes, warps, stages and split-K: the device's tuning table first, else a default
    (small tiles under the CPU interpreter)."""
    tuned = tuning.table(device).gemv.get((N, K, m_bucket(M))) if device.type == "cuda" else None
    if tuned is not None:
        return dict(tuned)
    bm = min(MAX_M, triton.next_power_of_2(M))
    if device.type != "cuda":
        return {"BLOCK_M": bm, "BLOCK_N": 4, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 1, "num_stages": 1}
    # the sweep's winners: M = 1, 4 rows x 2048 columns, 4 warps; M = 2, 4 x 512, 2 warps
    bn, bk, warps = (4, 2048, 4) if bm == 1 else (max(1, 8 // bm), 512, 2)
    split = 1  # about four programs per SM (132 on the H200), no split shorter than 2 chunks
    while triton.cdiv(N, bn) * split < 4 * 132 and K // (2 * split) >= 2 * bk and split < 8:
        split *= 2
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps, "num_stages": 1}


def use_gemv(M: int, N: int, K: int, device: torch.device | None = None) -> bool:
    """True when the device's tuning table lists (N, K) at this M: the sweep found this kernel
    faster than cuBLAS there."""
    return (N, K, m_bucket(M)) in tuning.table(device).gemv


def gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
         config: dict | None = None, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``x`` [M, K] @ ``weight`` [N, K]^T -> [M, N] in ``out_dtype`` (default ``x.dtype``).

    Args:
        x: activations, float16/bfloat16/float32, same dtype as ``weight``; rows may be strided.
        weight: [N, K] with contiguous rows (``stride(1) == 1``), e.g. an nn.Linear weight.
        out_dtype: float16/bfloat16/float32 (float32 lets an LM head skip a cast).
        config: override ``choose_config`` (benchmarks, tests).
        options: the engine's kernel options (programmatic dependent launch).
    Raises:
        ValueError: shapes, strides or dtypes the kernel does not take.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float16/bfloat16/float32 dtype, got {x.dtype}, {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError(f"weight rows must be contiguous (stride(1) == 1), got strides {weight.stride()}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype must be float16/bfloat16/float32, got {out_dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = dict(config or choose_config(M, N, K, x.device))
    bk = cfg["BLOCK_K"]
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(K, bk)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]), split)
    if split > 1:
        part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, grid[0] * grid[1])
    else:
        part = cnt = out
    _gemv_kernel[grid](
        x, weight, out, part, cnt, M, N, K, k_per_split, split, x.stride(0), weight.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, EVEN_K=K % bk == 0, HAS_SPLIT=split > 1,
        NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"], **launch_kwargs(x.device, options),
    )
    return out
