"""Placing a fetched folder (a LoRA adapter, an EAGLE head) into the engine cache whole.

Readers (the server, the operator's checks) look for the folder at its final path only, so
it is written into a temporary sibling ``.<name>.tmp-<pid>`` and renamed into place
(atomic on one filesystem); the temporary folder never outlives the call.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterable


def place_folder(out: Path, files: Iterable[Path], is_placed: Callable[[], bool], marker: str | None = None) -> None:
    """Copy ``files`` into a temporary sibling of ``out``, write an empty ``marker`` file in it
    last (if given), and rename it to ``out``.  A rename that fails because another fetch of
    the same folder got there first is not an error when ``is_placed()`` says ``out`` is
    whole.

    Raises:
        OSError: the folder cannot be written or renamed (and ``out`` is not whole).
    """
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        if marker is not None:
            (tmp / marker).write_text("")
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_placed():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
