"""Launch heuristics and argument checks shared by every launcher (one place, as Liger-Kernel's
``ops/utils.py``).  The numbers themselves are data: ``kiln.kernels.tuning`` (one table per device)."""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Union

import torch
import triton

from kiln.kernels import tuning
from kiln.kernels.platform import ensure_interpreter_compat, interpreting

ensure_interpreter_compat()

__all__ = [
    "interpreting",
    "next_power_of_2",
    "num_sms",
    "row_warps",
    "decode_num_splits",
    "attention_config",
    "check",
    "check_last_dim_contiguous",
    "scale_args",
    "record_compiles",
]


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.lru_cache(maxsize=None)
def _num_sms_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the default tuning table's ``num_sms`` for a CPU device)."""
    if device.type == "cuda":
        return _num_sms_cached(device.index if device.index is not None else torch.cuda.current_device())
    return tuning.table(device).num_sms


def row_warps(num_elements: int, device: Optional[torch.device] = None) -> int:
    """num_warps for a kernel whose program handles one row of ``num_elements`` on ``device``."""
    if interpreting():
        return 1
    table = tuning.table(device).row_warps
    for limit, warps in table:
        if num_elements <= limit:
            return warps
    return table[-1][1]


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device, max_context: Optional[int] = None) -> int:
    """Flash-decoding splits of the context so that the grid fills the GPU.

    One split when ``num_seqs * num_kv_heads >= SMs * single_split_programs_per_sm``; else
    the largest power of two not above ``SMs * programs_per_sm / (num_seqs * num_kv_heads)``,
    clamped to ``[min_splits, max_splits]`` (the tuning table's ``decode_split``); with ``max_context``
    no split is shorter than ``min_tokens_per_split``.  Depends only on host ints, never on
    device data, so it is fixed for a CUDA graph captured at one batch size.
    """
    cfg = tuning.table(device).decode_split
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= num_sms(device) * cfg["single_split_programs_per_sm"] and not interpreting():
        return 1  # the grid fills the GPU many times over: a split only adds partials and a merge
    raw = num_sms(device) * cfg["programs_per_sm"] / programs
    splits = 1 << max(0, int(raw).bit_length() - 1) if raw >= 1 else 1
    splits = max(cfg["min_splits"], min(splits, cfg["max_splits"]))
    if max_context is not None:
        splits = min(splits, max(1, max_context // cfg["min_tokens_per_split"]))
    if interpreting():
        splits = min(splits, 2)  # the CPU interpreter runs programs one by one
    return int(splits)


def attention_config(kind: str, device: Optional[torch.device] = None) -> dict:
    """Meta-parameters for the paged attention kernel on ``device`` (a fresh dict).

    ``kind``: "decode", "decode_fp8" or "prefill" (the tuning table's ``attention`` keys);
    under the CPU interpreter ``tuning.INTERPRETER_ATTENTION``.
    """
    if interpreting():
        return dict(tuning.INTERPRETER_ATTENTION)
    return dict(tuning.table(device).attention[kind])


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond."""
    if not cond:
        raise ValueError(msg)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.stride(-1) == 1, f"{name} must have a contiguous last dim, got strides {tuple(t.stride())}")


Scale = Union[float, torch.Tensor, None]


def scale_args(scale: Scale, num_kv_heads: int, dummy: torch.Tensor, name: str):
    """Kernel arguments ``(ptr, stride, value, mode)`` for a KV scale.

    mode 0: no scale (1.0); 1: the Python float ``value``; 2: a device tensor read at
    ``ptr[head * stride]`` (stride 0 for a 1-element tensor, 1 for a ``[num_kv_heads]`` one).
    A float scale costs no device copy (safe inside CUDA-graph capture).

    Raises:
        ValueError: a tensor scale on another device, of a size other than 1 or
            ``num_kv_heads``, or not contiguous.
    """
    if scale is None:
        return dummy, 0, 1.0, 0
    if isinstance(scale, torch.Tensor):
        check(scale.device == dummy.device, f"{name} is on {scale.device}, expected {dummy.device}")
        check(scale.dtype == torch.float32, f"{name} must be float32, got {scale.dtype}")
        n = scale.numel()
        check(n in (1, num_kv_heads), f"{name} has {n} elements, expected 1 or num_kv_heads={num_kv_heads}")
        check(n == 1 or scale.reshape(-1).stride(0) == 1, f"{name} must be contiguous")
        return scale, (0 if n == 1 else 1), 1.0, 2
    return dummy, 0, float(scale), 1


@contextlib.contextmanager
def record_compiles():
    """Record the Triton kernel variants compiled in this process while the block runs.

    Triton compiles a ``@triton.jit`` kernel on its first launch for each specialization
    (constexpr values, dtypes, integer arguments equal to 1 or divisible by 16): from about
    0.3 s (a hit in the on-disk cache) to a few seconds per variant, paid by whatever step
    launched it.  Yields a list that receives one ``"module:qualname"`` string per variant
    compiled (or loaded from the disk cache) inside the block; launches of variants already in
    the process's cache add nothing.  Uses ``triton.knobs.runtime.jit_post_compile_hook`` and
    restores the hook that was set before (which is still called).
    """
    from triton import knobs  # noqa: PLC0415

    log: list[str] = []
    prev = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        log.append(f"{getattr(fn, 'module', '?')}:{getattr(fn, 'name', '?')}")
        return prev(*args, **kwargs) if prev is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield log
    finally:
        knobs.runtime.jit_post_compile_hook = prev
