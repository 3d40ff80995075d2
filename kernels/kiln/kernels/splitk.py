"""Split-K in one launch, shared by the GEMV / W4A16 kernels (``gemv``, ``w4a16*``).

Where the output tiles alone do not fill the GPU, ``SPLIT_K`` programs share a tile, each over
a slice of K.  The reduction happens in the same launch (the decode step runs inside a CUDA
graph, where every extra launch costs microseconds): every program writes its float32 partial
tile to ``part`` ``[SPLIT_K, M, N]``, bumps the tile's arrival counter (acquire-release, GPU
scope), and the last one to arrive adds all partials **in split order** (so the result does not
depend on which split finished last: bit-reproducible), writes ``y`` and resets the counter to
zero for the next launch.  The same scheme as "stream-K / split-K with semaphore" fix-up in
CUTLASS; the code is Kiln's own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["finish_tile", "counters"]

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_NUM_COUNTERS = 1 << 16


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``n`` split-K tiles on ``device`` (int32 [>= n]).

    One buffer per device, shared by all kernels and launches: launches on one stream run one
    after the other (with programmatic dependent launch a kernel touches memory only after its
    predecessor finished), and each resets the counters it used before it ends."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, _NUM_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@triton.jit
def finish_tile(y, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k, tile, SPLIT_K,
                HAS_SPLIT: tl.constexpr):
    """Store the float32 ``[BLOCK_M, BLOCK_N]`` result ``y`` of rows ``offs_m`` and columns
    ``offs_n`` (cast to ``out_ptr``'s dtype), or, with ``HAS_SPLIT``, this split's partial, and
    let the last split of ``tile`` add the partials in split order and store the sum."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if not HAS_SPLIT:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, y, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # sums in split order, whichever split is last: bit-reproducible
            y = tl.zeros(y.shape, dtype=tl.float32)
            for s in range(SPLIT_K):
                y += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)
