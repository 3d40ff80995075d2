"""Programmatic dependent launch (PDL) for the chains of short kernels of a decode step.

At batch 1-16 a decode step is a chain of short kernels (per layer: norm, qkv GEMV, rotary, KV
write, attention, o GEMV, norm, gate_up GEMV, SiLU-and-mul, down GEMV), a few microseconds
each.  Launched the ordinary way, a kernel's programs are scheduled only after its predecessor
has finished and its writes are flushed, so every launch adds the scheduling of a new grid to
the step (inside a CUDA graph too).

Hopper's programmatic dependent launch (CUDA ``cudaLaunchAttributeProgrammaticStreamSerialization``,
PTX ``griddepcontrol``; TensorRT-LLM launches its kernels this way) lets a kernel's programs be
scheduled while its predecessor still runs: the kernel is launched with ``launch_pdl=True`` and
first executes ``griddepcontrol.wait`` (``gdc_wait``), which returns once every prerequisite
grid has completed and its memory is visible, then ``griddepcontrol.launch_dependents``
(``gdc_launch_dependents``), which lets its own successor be scheduled.  Kiln's kernels do both
first thing (``pdl_start``), before any load or store, so the data dependencies are exactly
those of ordinary stream order; what overlaps is the grid launch and program setup.  A kernel
launched the ordinary way after a PDL kernel (cuBLAS, torch ops) waits for it as usual; a PDL
kernel after an ordinary one starts when that one completes.  CUDA graphs keep the
programmatic edges (CUDA >= 12.3).

A variant that also asked the L2 to prefetch the GEMV weights before the wait (Hopper's
``cp.async.bulk.prefetch.L2``) was measured and dropped (docs/benchmarks.md, session 7).
Loading the first weight step into registers before the wait (``w4a16`` ``EARLY``,
``KILN_W4A16_EARLY=1``) sped GEMV chains up alone (qkv 7.5 -> 6.7 us) but not after a norm,
and made the batch-1 int4 decode step slower (2.229 vs 2.103 ms of GPU per step, session 11):
off by default.

``launch_kwargs(device)`` gives the launch arguments: ``PDL=True, launch_pdl=True`` on a CUDA
device of compute capability >= 9.0 outside the CPU interpreter unless ``KILN_PDL=0``, else
``PDL=False``.  Every kernel that takes them declares ``PDL: tl.constexpr`` and calls
``pdl_start(PDL)`` as its first statement.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["pdl_enabled", "launch_kwargs", "pdl_start"]


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_enabled(device: torch.device) -> bool:
    """True when kernels on ``device`` may use programmatic dependent launch: CUDA, compute
    capability >= 9.0 (Hopper), not ``TRITON_INTERPRET=1``, and ``KILN_PDL`` is not ``0``
    (read at every launch, so a process can time both)."""
    if device.type != "cuda" or os.environ.get("KILN_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def launch_kwargs(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on ``device``: ``{"PDL": True, "launch_pdl": True}``
    where ``pdl_enabled``, else ``{"PDL": False}``."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch_kwargs``: wait for the predecessor
    grid (its writes visible), then let the successor be scheduled.  No-op when ``PDL`` is False."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
