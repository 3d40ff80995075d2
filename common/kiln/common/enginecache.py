"""The engine cache folder (a claim's ``/engines``): what it holds and how engines leave it.

Torch-free: ``kiln engines list`` and ``kiln engines gc`` run it on the claim (the operator's
cleanup Job), the operator reads the report the Job leaves in its termination message.

Layout: ``<root>/<hash>/`` per complete engine (``kiln.common.manifest``), ``<root>/.<hash>.tmp-*``
while a build writes one, plus Kiln's own folders (``.compile-cache``, ``.hf-cache``), which are
never touched here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from .constants import COMPLETE_MARKER, HASH_LENGTH, MANIFEST_FILENAME
from .manifest import is_engine_complete

__all__ = ["EngineEntry", "GcReport", "folder_bytes", "list_engines", "collect", "format_build_report",
           "parse_build_report"]

_HASH = re.compile(rf"[0-9a-f]{{{HASH_LENGTH}}}")


@dataclass(frozen=True)
class EngineEntry:
    """One engine folder: ``hash``, ``bytes`` on disk, ``complete`` (a finished engine or
    head), ``building`` (a build's temporary folder of this hash exists next to it), ``kind``:
    ``engine`` (a ``kiln build`` engine), ``eagle-head`` (an EAGLE head ``kiln head fetch``
    wrote: the completion marker and a ``config.json``, no engine manifest) or ``unknown``
    (neither, e.g. a build that stopped half-way)."""

    hash: str
    bytes: int
    complete: bool
    building: bool = False
    kind: str = "engine"


def _kind(d: Path) -> tuple[str, bool]:
    """``(kind, complete)`` of a folder named by a hash (see ``EngineEntry``)."""
    if is_engine_complete(str(d)):
        return "engine", True
    if (d / COMPLETE_MARKER).is_file() and not (d / MANIFEST_FILENAME).exists() and (d / "config.json").is_file():
        return "eagle-head", True
    return ("engine" if (d / MANIFEST_FILENAME).exists() else "unknown"), False


@dataclass
class GcReport:
    """What ``collect`` did.

    Fields:
        removed: ``{hash: bytes}`` of the engines deleted.
        kept: ``{hash: reason}`` of requested engines left in place (``building``,
            ``missing``, ``space``: the claim had enough free space for a spare one).
        free_bytes / total_bytes: the filesystem's free and total space afterwards.
        engines: ``{hash: bytes}`` of the engines left.
    """

    removed: dict[str, int] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    free_bytes: int = 0
    total_bytes: int = 0
    engines: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        """One line of JSON (at most a termination message's 4096 bytes: ``engines`` is
        dropped first when it would not fit)."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        if len(text) > 4000:
            text = json.dumps({**asdict(self), "engines": {}}, sort_keys=True, separators=(",", ":"))
        return text


def folder_bytes(path: str | os.PathLike) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed); 0 when it is gone."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            total += st.st_size
    return total


def _building(root: Path, h: str) -> bool:
    return any(root.glob(f".{h}.tmp-*"))


def list_engines(root: str | os.PathLike) -> list[EngineEntry]:
    """The engines under ``root`` (folders named by a hash), sorted by hash.  Raises
    ``FileNotFoundError`` when ``root`` does not exist."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"engine cache {root} does not exist")
    out = []
    for d in sorted(root.iterdir()):
        if d.is_dir() and not d.is_symlink() and _HASH.fullmatch(d.name):
            kind, complete = _kind(d)
            out.append(EngineEntry(d.name, folder_bytes(d), complete, _building(root, d.name), kind))
    return out


def _free(root: Path) -> tuple[int, int]:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def collect(root: str | os.PathLike, remove: Iterable[str] = (), spare: Iterable[str] = (),
            min_free_bytes: int = 0, no_build_running: bool = False) -> GcReport:
    """Delete the engines ``remove`` (expired), then the engines ``spare`` in their order (the
    oldest unused first) while the filesystem has less than ``min_free_bytes`` free.  An engine
    a build is writing (a temporary folder of its hash exists) is never deleted, unless
    ``no_build_running`` (the caller knows no build writes into ``root``, as the operator does
    when it runs its cleanup): then such folders are what a killed build left, and they are
    deleted with their engine.  Each engine is first renamed out of its path (atomic: a reader
    never sees half an engine), then removed.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: a name that is not an engine hash.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"engine cache {root} does not exist")
    report = GcReport()
    remove, spare = list(remove), [h for h in spare if h not in set(remove)]
    for h in remove + spare:
        if not _HASH.fullmatch(h):
            raise ValueError(f"{h!r} is not an engine hash ({HASH_LENGTH} hex digits)")

    def drop(h: str) -> None:
        d = root / h
        leftovers = 0
        if _building(root, h):
            if not no_build_running:
                report.kept[h] = "building" if d.is_dir() else "missing"
                return
            for tmp in root.glob(f".{h}.tmp-*"):  # a killed build's
                leftovers += folder_bytes(tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        if not d.is_dir():
            if leftovers:
                report.removed[h] = leftovers
            else:
                report.kept[h] = "missing"
            return
        size = folder_bytes(d) + leftovers
        trash = root / f".{h}.deleting"
        os.rename(d, trash)
        shutil.rmtree(trash, ignore_errors=True)
        report.removed[h] = size

    for h in remove:
        drop(h)
    for h in spare:
        if _free(root)[0] >= min_free_bytes:
            report.kept[h] = "space"
            continue
        drop(h)
    for stale in root.glob(".*.deleting"):  # a cleanup killed between rename and remove
        shutil.rmtree(stale, ignore_errors=True)
    report.free_bytes, report.total_bytes = _free(root)
    report.engines = {e.hash: e.bytes for e in list_engines(root)}
    return report


# --- the build's report: what a succeeded build Job leaves in its termination message ------

BUILD_REPORT_PREFIX = "kiln build: built "


def format_build_report(engine_hash: str, num_bytes: int, accuracy: dict | None = None,
                        shape: dict | None = None) -> str:
    """The termination message of a succeeded build: the engine, its size on disk, with an
    accuracy gate the measured numbers, and the sizes tensor parallelism splits
    (``shape``: ``kiln.common.tensorparallel.ParallelShape.to_dict``) (``kiln build`` writes
    it; the operator keeps it in the engine record and checks ``runtime.tensorParallelSize``
    against it before the Deployment)."""
    body: dict = {"engineHash": engine_hash, "bytes": int(num_bytes)}
    if accuracy:
        body["accuracy"] = accuracy
    if shape:
        body["shape"] = shape
    return BUILD_REPORT_PREFIX + json.dumps(body, sort_keys=True, separators=(",", ":"))


def parse_build_report(message: str) -> dict | None:
    """The report of ``format_build_report`` in a termination message, or None."""
    text = (message or "").strip()
    if not text.startswith(BUILD_REPORT_PREFIX):
        return None
    try:
        body = json.loads(text[len(BUILD_REPORT_PREFIX):])
    except ValueError:
        return None
    return body if isinstance(body, dict) and isinstance(body.get("bytes"), int) else None
