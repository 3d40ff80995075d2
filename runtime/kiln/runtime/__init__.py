"""Kiln's inference runtime: paged KV cache, in-flight batching, OpenAI-compatible server.

``from kiln.runtime import LLM, SamplingParams`` is the offline API.  The names are
resolved lazily so that torch-free modules of this package (``kiln.runtime.core``) can be
imported without pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]

_LAZY = {
    "LLM": "kiln.runtime.llm",
    "LoRARequest": "kiln.runtime.lora",
    "SamplingParams": "kiln.runtime.sampling_params",
    "RequestOutput": "kiln.runtime.outputs",
    "CompletionOutput": "kiln.runtime.outputs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
