"""Dequantize the packed int4 format to a float16/bfloat16 weight (``KERNEL: "dequant"``).

For large M (prefill, big batches) a W4A16 GEMM is compute-bound, and the tensor-core kernel
that dequantizes every weight tile in its main loop (``mma``) spends most of its
time on the dequantization: on an H200 it ran 5-15x slower than bf16 cuBLAS at M = 128 on the
Llama-3.1-8B projections.  Writing the whole weight out once per call (``N K`` 16-bit values,
235 MB for gate_up) and then running cuBLAS costs one extra weight pass and wins from M = 65
on: H200 (docs/benchmarks.md, ``benchmarks/gpu_bench.py --only w4a16-large``): dequantization
alone 22 us (o) to 135 us (gate_up), 1.6-1.75 TB/s written; the whole GEMM at M = 128 45 vs
168 us (qkv) and 199 vs 343 us (gate_up) for ``mma``, at 2048 1.2x bf16 cuBLAS.  vLLM's AWQ
path does the same above 256 tokens (``awq_dequantize`` + ``torch.matmul``); the code here is
Kiln's own.

The kernel: a program turns the packed words of ``BLOCK_N`` columns x ``BLOCK_K`` K columns
(``kiln.kernels.int4_format``: nibble ``i`` of packed row ``8 b + r`` is ``W[n, 64 b + 8 i +
r]``) into ``W[n, k] = (q - z) * s`` (float32, rounded once), scale and zero point per (group,
column), laid out so that the stores into ``W`` ``[N, K]`` (row-major) are whole 128-byte
lines (1.6-1.75 TB/s written; storing 16-byte pieces of 32 rows per instruction writes at
0.42 TB/s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.pdl import launch_kwargs, pdl_start


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_wn,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    # Tile [BLOCK_N, RB, 64]: element (n, rb, c) is W[n, 64 rb + c], c = 8 i + r: nibble i of
    # packed row 8 rb + r.  The last axis is 64 consecutive K columns of one row of W, so the
    # stores are 16-byte vectors of adjacent threads (whole 128-byte lines); a packed word is
    # loaded by the eight threads that need it (one transaction), the scale and zero point by
    # all threads of the (n, group) (the same way).
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    RB: tl.constexpr = BLOCK_K // 64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = offs_n[:, None, None]
    rb3 = (pid_k * RB + tl.arange(0, RB))[None, :, None]
    c3 = tl.arange(0, 64)[None, None, :]
    mask = (n3 < N) & (rb3 < K // 64) & (c3 < 64)
    p = tl.load(qw_ptr + (8 * rb3 + c3 % 8) * stride_qk + n3.to(tl.int64) * stride_qn, mask=mask, other=0)
    g = (64 * rb3 + c3) // GROUP_SIZE
    s = tl.load(s_ptr + g * stride_sg + n3 * stride_sn, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_zg + n3 * stride_zn, mask=mask, other=0).to(tl.float32)
    q = ((p >> (4 * (c3 // 8))) & 0xF).to(tl.float32)
    tl.store(w_ptr + n3.to(tl.int64) * stride_wn + 64 * rb3 + c3, ((q - z) * s).to(w_ptr.dtype.element_ty), mask=mask)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, dtype: torch.dtype,
               block_n: int = 32, block_k: int = 256, num_warps: int = 8,
               options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``W`` [N, K] in ``dtype`` (float16/bfloat16/float32) from the packed format.

    Args:
        qweight: int32 [K // 8, N]; scales: float [K // G, N]; qzeros: uint8 [K // G, N] (any
            strides; shapes checked by the caller, ``w4a16.w4a16_gemm``).
        block_n, block_k: the tile of W per program (powers of two, ``block_k % 64 == 0``).
        options: the engine's kernel options (programmatic dependent launch).
    Returns:
        a new contiguous tensor; ``W[n, k] = (code - z) * s`` rounded once to ``dtype``.
    """
    K8, N = qweight.shape
    K = K8 * 8
    G = K // scales.shape[0]
    w = torch.empty((N, K), dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(K, block_k), triton.cdiv(N, block_n))
    _dequant_kernel[grid](qweight, scales, qzeros, w, N, K, qweight.stride(0), qweight.stride(1), scales.stride(0),
                          scales.stride(1), qzeros.stride(0), qzeros.stride(1), w.stride(0),
                          GROUP_SIZE=G, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                          **launch_kwargs(qweight.device, options))
    return w
