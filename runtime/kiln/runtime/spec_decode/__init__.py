"""Speculative decoding: proposers of draft tokens behind one interface (n-gram / prompt
lookup, a draft model, EAGLE heads), their settings and their statistics.

The layout follows vLLM V1 (``vllm/v1/spec_decode/``): a proposer guesses the next ``k``
tokens of a sequence; the target model computes the sequence's last token and the ``k``
drafts in one forward pass; the sampler (``kiln.runtime.rejection_sampler``) keeps the
longest prefix the target agrees with plus one token of its own; the scheduler rolls the
rejected drafts' KV slots back.  The settings (``SpeculativeConfig``) and the n-gram
proposer are torch-free.
"""

from .config import SPECULATIVE_METHODS, SpeculativeConfig  # noqa: F401
from .stats import SpecDecodeStats  # noqa: F401
