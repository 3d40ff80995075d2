"""Dequantize the packed int4 format to a float16/bfloat16 weight (``KERNEL: "dequant"``).

For large M (prefill, big batches) a W4A16 GEMM is compute-bound, and the tensor-core kernel
that dequantizes every weight tile in its main loop (``w4a16._mma_kernel``) spends most of its
time on the dequantization: on an H200 it ran 7-9x slower than bf16 cuBLAS at M >= 128 on the
Llama-3.1-8B projections.  Writing the whole weight out once per call (``N K`` 16-bit values,
235 MB for gate_up) and then running cuBLAS costs one extra weight pass and wins at large M:
H200, session 8 (docs/benchmarks.md): dequantization alone 40 us (o) to 640 us (gate_up), the
whole GEMM at M = 2048 261 vs 1016 us (qkv) and 1245 vs 4625 us (gate_up) for ``mma``.  The
kernel writes only ~0.4-0.5 TB/s (far from the ~4 TB/s a copy reaches): the crossover
(``w4a16.DEQUANT_MIN_M`` = 512) would move down with a faster one.  vLLM's AWQ path does the
same above 256 tokens (``awq_dequantize`` + ``torch.matmul``); the code here is Kiln's own.

The kernel: a program turns the packed words of ``BLOCK_N`` columns x ``BLOCK_K`` K columns
(format in ``w4a16``'s docstring: nibble ``i`` of packed row ``8 b + r`` is ``W[n, 64 b + 8 i +
r]``) into ``W[n, k] = (q - z) * s``, scale and zero point per (group, column), and stores
them into ``W`` ``[N, K]`` (row-major, K contiguous) as 16-byte runs (the eight packed rows of
a block are eight consecutive K columns per nibble).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_kwargs, pdl_start


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_wn,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    # Tile [BLOCK_N, RB, 8]: column n, 64-column block rb, packed row r.  Nibble i of it is
    # W[n, 64 rb + 8 i + r]: eight consecutive K columns along r, so every store is a 16-byte
    # run of a row of W (the loads, 8x fewer bytes, take the layout change).
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    RB: tl.constexpr = BLOCK_K // 64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = offs_n[:, None, None]
    rb3 = (pid_k * RB + tl.arange(0, RB))[None, :, None]
    r3 = tl.arange(0, 8)[None, None, :]
    mask = (n3 < N) & (rb3 < K // 64) & (r3 < 8)
    p = tl.load(qw_ptr + (8 * rb3 + r3) * stride_qk + n3.to(tl.int64) * stride_qn, mask=mask, other=0)
    w_base = w_ptr + n3.to(tl.int64) * stride_wn + 64 * rb3 + r3  # [BLOCK_N, RB, 8]
    n2 = offs_n[:, None]
    rb2 = (pid_k * RB + tl.arange(0, RB))[None, :]
    mask2 = (n2 < N) & (rb2 < K // 64)
    for i in tl.static_range(8):
        # scale and zero point per (column, block): [BLOCK_N, RB], one load per thread and block
        g = (64 * rb2 + 8 * i) // GROUP_SIZE
        s = tl.load(s_ptr + g * stride_sg + n2 * stride_sn, mask=mask2, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_zg + n2 * stride_zn, mask=mask2, other=0).to(tl.float32)
        q = ((p >> (4 * i)) & 0xF).to(tl.float32)
        tl.store(w_base + 8 * i, ((q - z[:, :, None]) * s[:, :, None]).to(w_ptr.dtype.element_ty), mask=mask)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, dtype: torch.dtype,
               block_n: int = 64, block_k: int = 512, num_warps: int = 4) -> torch.Tensor:
    """``W`` [N, K] in ``dtype`` (float16/bfloat16/float32) from the packed format.

    Args:
        qweight: int32 [K // 8, N]; scales: float [K // G, N]; qzeros: uint8 [K // G, N] (any
            strides; shapes checked by the caller, ``w4a16.w4a16_gemm``).
        block_n, block_k: the tile of W per program (powers of two, ``block_k % 64 == 0``).
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
                          **launch_kwargs(qweight.device))
    return w
