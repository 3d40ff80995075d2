"""Launch configurations of Kiln's kernels: data files keyed by device, and their loader.

Each ``<device>.json`` in this folder holds the measured launch choices for one GPU model
(``h200.json``: one NVIDIA H200; the numbers behind each entry are in its ``"measured"``
field and in docs/benchmarks.md, "Kernels").  ``table(device)`` picks the file whose
``"device"`` name is part of the CUDA device's name; a GPU with no table of its own (and the
CPU interpreter) uses ``DEFAULT_TABLE``, the H200's, the only device measured so far.  Plain
data, no Triton import: the launchers read it through ``kiln.kernels.launch``.

Keys of a table:

* ``num_sms``: SMs assumed when no CUDA device is visible (the H200 has 132);
* ``attention``: paged-attention meta-parameters per mode (``decode``, ``decode_fp8``,
  ``prefill``; ``kiln.kernels.attention``);
* ``decode_split``: the flash-decoding split heuristic (``launch.decode_num_splits``);
* ``row_warps``: ``[[max elements, num_warps], ...]`` of row-wise kernels (RMSNorm, rotary,
  KV write);
* ``elementwise``: elements per program and warps of SiLU-and-mul;
* ``gemv`` / ``w4a16``: per-problem configs keyed ``"NxKxB"`` (N, K, M bucket) for
  ``kiln.kernels.gemv`` and ``kiln.kernels.w4a16``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Table", "table", "load", "DEFAULT_TABLE", "INTERPRETER_ATTENTION", "ATTENTION", "DECODE_SPLIT",
           "ROW_WARPS", "ELEMENTWISE", "DEFAULT_NUM_SMS"]

_DIR = Path(__file__).resolve().parent
DEFAULT_TABLE = "h200"

# Attention tiles under TRITON_INTERPRET=1 (CPU tests): small and quick, for any device.
INTERPRETER_ATTENTION = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}


def _configs(raw: dict[str, dict]) -> dict[tuple[int, int, int], dict]:
    """``{"NxKxB": {...}}`` -> ``{(N, K, B): {...}}`` without the ``measured`` notes."""
    out = {}
    for key, cfg in raw.items():
        n, k, b = (int(v) for v in key.split("x"))
        out[(n, k, b)] = {kk: vv for kk, vv in cfg.items() if kk != "measured"}
    return out


@dataclass(frozen=True)
class Table:
    """One device's launch choices (see the module doc for the fields' meaning)."""

    device: str
    num_sms: int
    attention: dict[str, dict[str, Any]]
    decode_split: dict[str, int]
    row_warps: tuple[tuple[int, int], ...]
    elementwise: dict[str, int]
    gemv: dict[tuple[int, int, int], dict]
    w4a16: dict[tuple[int, int, int], dict]


@functools.lru_cache(maxsize=None)
def load(name: str) -> Table:
    """The table in ``<name>.json`` of this folder.

    Raises:
        FileNotFoundError: no such table; ValueError / KeyError: a malformed file.
    """
    raw = json.loads((_DIR / f"{name}.json").read_text())
    strip = lambda d: {k: v for k, v in d.items() if k != "measured"}  # noqa: E731
    return Table(
        device=raw["device"], num_sms=int(raw["num_sms"]),
        attention={k: strip(v) for k, v in raw["attention"].items()},
        decode_split=strip(raw["decode_split"]),
        row_warps=tuple((int(a), int(b)) for a, b in raw["row_warps"]),
        elementwise=strip(raw["elementwise"]),
        gemv=_configs(raw["gemv"]), w4a16=_configs(raw["w4a16"]),
    )


@functools.lru_cache(maxsize=None)
def _name_for(device_name: str) -> str:
    for path in sorted(_DIR.glob("*.json")):
        if json.loads(path.read_text())["device"].lower() in device_name.lower():
            return path.stem
    return DEFAULT_TABLE


def table(device=None) -> Table:
    """The table for ``device`` (a ``torch.device``; None, a non-CUDA device, or a CUDA device
    on a machine without one, as in planning tests: the default table).  Cached per device
    name; the CUDA name is read once per device index."""
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return load(DEFAULT_TABLE)
    name = _cuda_name(device.index)
    return load(_name_for(name) if name else DEFAULT_TABLE)


@functools.lru_cache(maxsize=None)
def _cuda_name(index) -> str:
    """The CUDA device's name ("" when no CUDA device is visible)."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_name(index if index is not None else torch.cuda.current_device())


# The default table's entries under their historical names (tests, benchmarks).
_DEFAULT = load(DEFAULT_TABLE)
ATTENTION = _DEFAULT.attention
DECODE_SPLIT = _DEFAULT.decode_split
ROW_WARPS = _DEFAULT.row_warps
ELEMENTWISE = _DEFAULT.elementwise
DEFAULT_NUM_SMS = _DEFAULT.num_sms
