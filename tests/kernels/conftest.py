"""Kernel tests: run every Triton kernel against its torch reference.

Without a CUDA device the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1``
is set here, before anything imports ``kiln.kernels`` (``triton.jit`` picks the interpreter
at decoration time), unless the caller already set it.  With a CUDA device the variable is
left alone and the same tests run compiled on the GPU, plus the ``@pytest.mark.gpu``
real-size cases.

Leakage: pytest loads this file only when it collects tests/kernels; the variable then
stays set for the rest of that pytest process (and its subprocesses).  That is harmless
there: no other test folder runs Triton on the CPU, and on a GPU machine it is never set.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from kiln.kernels.interp_compat import apply as _apply_interp_fix  # noqa: E402

    _apply_interp_fix()

_HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device (real-size case)")
    for item in items:
        if _HERE not in Path(item.fspath).resolve().parents:
            continue  # only this folder's tests
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
