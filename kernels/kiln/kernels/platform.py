"""Where the kernels run: Triton's CPU interpreter or a GPU.

``interpreting()`` asks Triton whether its CPU interpreter is on (``triton.knobs``, which
reads Triton's own ``TRITON_INTERPRET``; Kiln's kernel tests set it, it is not a Kiln
setting).  Plain Python: no torch or Triton import at module load.
"""

from __future__ import annotations

__all__ = ["interpreting", "ensure_interpreter_compat"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``triton.knobs.runtime.interpret``,
    Triton 3.4+); False without Triton (the torch reference path runs then)."""
    try:
        from triton import knobs  # noqa: PLC0415
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)


def ensure_interpreter_compat() -> None:
    """Under the interpreter, patch Triton 3.6's interpreter for NumPy >= 2.4 once
    (``kiln.kernels.interp_compat``); a no-op on a GPU.  Called when a kernel module loads."""
    if interpreting():
        from kiln.kernels.interp_compat import apply  # noqa: PLC0415

        apply()
