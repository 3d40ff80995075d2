"""N-gram (prompt lookup) proposer: no model, the sequence itself is the draft.

Prompt lookup decoding (Saxena, 2023; vLLM's ``NgramProposer``): take the last ``n`` tokens
of the sequence (prompt + output), ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``; find their most recent earlier occurrence; propose the ``k`` tokens
that followed it.  Editing, summarising, code changes and retrieval answers copy long runs of
their prompt, which this guesses for the price of a search.  Torch-free (numpy).
"""

from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """The drafts for a sequence.

    Args:
        tokens: int64 [L], the sequence's known tokens (prompt + output).
        k: most drafts to return (tokens).
        n_min, n_max: the suffix lengths tried, longest first (tokens).
    Returns:
        Up to ``k`` token ids that followed the most recent earlier occurrence of the longest
        matching suffix (fewer when that occurrence is near the end); ``[]`` without a match.
    """
    L = int(tokens.shape[0])
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        # windows starting at 0 .. L-n-1: every occurrence that ends before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Proposes drafts by prompt lookup for each sequence, before the step is scheduled.

    Args:
        k: drafts per sequence and step (tokens).
        n_min, n_max: the n-gram window (tokens; ``SpeculativeConfig.prompt_lookup_*``).
    """

    #: drafts are known before scheduling (no KV slots or model needed to make them)
    needs_model = False

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Drafts for one sequence's ``token_ids`` (prompt + output), at most ``k`` (default
        the configured count)."""
        k = self.k if k is None else k
        if k <= 0 or len(token_ids) < self.n_min + 1:
            return []
        return ngram_propose(np.asarray(token_ids, dtype=np.int64), k, self.n_min, self.n_max)
