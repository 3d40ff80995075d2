"""Where the kernels run: Triton's CPU interpreter or a GPU.

``interpreting()`` is the one place that reads ``TRITON_INTERPRET``, Triton's own switch for
its CPU interpreter (Kiln's kernel tests set it; it is not a Kiln setting).  Plain Python: no
torch or Triton import at module load.
"""

from __future__ import annotations

import os

__all__ = ["interpreting", "ensure_interpreter_compat"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Read through ``triton.knobs.runtime.interpret`` when this Triton has knobs (3.4+), else
    from the environment variable Triton itself reads."""
    try:
        from triton import knobs  # noqa: PLC0415
    except ImportError:
        knobs = None
    if knobs is not None and hasattr(knobs, "runtime") and hasattr(knobs.runtime, "interpret"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # Triton's own switch


def ensure_interpreter_compat() -> None:
    """Under the interpreter, patch Triton 3.6's interpreter for NumPy >= 2.4 once
    (``kiln.kernels.interp_compat``); a no-op on a GPU.  Called when a kernel module loads."""
    if interpreting():
        from kiln.kernels.interp_compat import apply  # noqa: PLC0415

        apply()
