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

``launch_kwargs(device, options)`` gives the launch arguments: ``PDL=True, launch_pdl=True``
on a CUDA device of compute capability >= 9.0 outside the CPU interpreter when
``options.pdl`` (``kiln.kernels.options.KernelOptions``), else ``PDL=False``.  Every kernel that takes them declares ``PDL: tl.constexpr`` and calls
``pdl_start(PDL)`` as its first statement.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.platform import ensure_interpreter_compat, interpreting

ensure_interpreter_compat()

__all__ = ["pdl_enabled", "launch_kwargs", "pdl_start"]


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_enabled(device: torch.device, options: KernelOptions = DEFAULT_OPTIONS) -> bool:
    """True when kernels on ``device`` use programmatic dependent launch: ``options.pdl``, a
    CUDA device of compute capability >= 9.0 (Hopper), and not Triton's CPU interpreter."""
    if device.type != "cuda" or not options.pdl or interpreting():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def launch_kwargs(device: torch.device, options: KernelOptions = DEFAULT_OPTIONS) -> dict:
    """Keyword arguments for a kernel launch on ``device``: ``{"PDL": True, "launch_pdl": True}``
    where ``pdl_enabled(device, options)``, else ``{"PDL": False}``."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device, options) else {"PDL": False}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch_kwargs``: wait for the predecessor
    grid (its writes visible), then let the successor be scheduled.  No-op when ``PDL`` is False."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
