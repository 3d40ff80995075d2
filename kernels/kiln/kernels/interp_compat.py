"""Make Triton 3.6's CPU interpreter work with NumPy >= 2.4.

Applied by ``import kiln.kernels`` when ``TRITON_INTERPRET=1`` is set (the CPU kernel
tests, and any user running the kernels on the CPU under the interpreter).

NumPy 2.4 raises TypeError on ``int(array_of_shape_1)``; Triton 3.6's interpreter does that
when a loaded scalar is used as a loop bound (``range(lo, hi)``).  Upstream fix:
triton-lang/triton#9172 (issue #9171), not in 3.6.0.  This applies the same one-line change
(``int(data.squeeze())``) by wrapping ``_patch_lang_tensor``.  Harmless on fixed versions.
"""

from __future__ import annotations


def apply() -> None:
    """Patch the interpreter once (idempotent)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_kiln_numpy24_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._kiln_numpy24_fix = True
    interpreter._patch_lang_tensor = patched
