"""Speculative decoding settings (torch-free): the method, the draft length, the draft
model, the n-gram window and the batch size above which speculation is switched off."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: ``ngram``: prompt lookup (no model); ``draft``: a smaller model (or a quantized engine
#: of the target) sharing the target's tokenizer; ``eagle``: an EAGLE or EAGLE-3 head
#: checkpoint (the layout is read from its tensors).
SPECULATIVE_METHODS = ("ngram", "draft", "eagle")

#: Drafts per step when ``num_speculative_tokens`` is not given (tokens).
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
#: Running sequences above which the engine decodes without speculation, per method, when
#: ``disable_by_batch_size`` is not given; at or below it the engine drafts where it measures
#: that drafts pay (``switch_off.SwitchOff``).  On an H100 no method paid above 2 sequences
#: (docs/benchmarks.md, "Speculative decoding"): a batched step is bound by compute sooner
#: than by reading the weights, and verifying ``k`` drafts per sequence then costs more than
#: it saves.  The verify step's CUDA graphs and a draft model's KV pool are sized by it.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 8, "draft": 8, "eagle": 8}


@dataclass(frozen=True)
class SpeculativeConfig:
    """What ``--speculative-method`` and its companion flags select.

    Fields:
        method: one of ``SPECULATIVE_METHODS``.
        num_speculative_tokens: drafts proposed per sequence and step (tokens, 1..16).
        model: the draft model or EAGLE head (``draft``/``eagle``): anything ``--model``
            takes (a builtin, a .gguf, a Hugging Face folder) or a ``kiln build`` engine
            folder (``draft``); None for ``ngram``.
        prompt_lookup_min / prompt_lookup_max: n-gram window (tokens): the longest suffix of
            the sequence, ``max`` down to ``min`` tokens, that occurred before proposes the
            tokens that followed it (vLLM's names).
        disable_by_batch_size: running sequences above which no drafts are proposed; given,
            every step at or below it drafts (None: up to the method's default, where measured
            to pay).

    Raises:
        ValueError: in ``__post_init__`` for an unknown method, an out-of-range count, a
            window with min > max, a model given to ``ngram`` or missing for the others.
    """

    method: str
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name, low, high in (("num_speculative_tokens", 1, 16), ("prompt_lookup_min", 1, 64),
                                ("prompt_lookup_max", 1, 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} is larger than prompt_lookup_max "
                             f"{self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and (type(self.disable_by_batch_size) is not int
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"speculative_disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative method ngram uses no model; leave out speculative_model")
        if self.method != "ngram" and not self.model:
            raise ValueError(f"speculative method {self.method} needs speculative_model (the "
                             f"{'draft model' if self.method == 'draft' else 'EAGLE head checkpoint'})")

    def check_sources(self) -> None:
        """Before the target loads (the draft or head is read after it): an EAGLE head's
        folder must hold its config (ValueError otherwise)."""
        if self.method == "eagle" and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"speculative model {self.model}: an EAGLE head is a folder with config.json and its "
                             "weights (safetensors or pytorch_model.bin)")

    @property
    def max_batch_size(self) -> int:
        """Running sequences up to which drafts are proposed (sequences)."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return DEFAULT_DISABLE_BY_BATCH_SIZE[self.method]
