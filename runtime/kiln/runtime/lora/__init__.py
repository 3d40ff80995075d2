"""Multi-LoRA serving: PEFT adapters on one base model, switched per request.

``peft_format`` reads and checks adapters, ``layers`` wraps the target linears (the
transform) and holds the batched delta, ``manager`` keeps the registry, the host cache and
the device slots.  The kernels are ``kiln.kernels.lora``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .peft_format import LoRAError


@dataclass(frozen=True)
class LoRARequest:
    """Selects an adapter for a request of the offline ``LLM``: ``name`` of a loaded adapter;
    with ``path`` it is loaded first when not loaded yet (vLLM's ``LoRARequest`` carries a
    name, an id and a path; Kiln numbers adapters itself)."""

    name: str
    path: str | None = None


__all__ = ["LoRAError", "LoRARequest"]
