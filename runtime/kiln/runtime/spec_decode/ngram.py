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

    Every earlier position holding the sequence's last token is a candidate end of a match;
    the candidates' match lengths grow backwards one token at a time (at most ``n_max``
    comparisons over the candidates, instead of one pass over the whole sequence per suffix
    length).

    Args:
        tokens: int64 [L], the sequence's known tokens (prompt + output).
        k: most drafts to return (tokens).
        n_min, n_max: the suffix lengths tried, longest first (tokens; ``n_min >= 1``).
    Returns:
        Up to ``k`` token ids that followed the most recent earlier occurrence of the longest
        matching suffix (fewer when that occurrence is near the end); ``[]`` without a match.
    """
    L = int(tokens.shape[0])
    n_top = min(n_max, L - 1)
    if n_top < n_min or L < 2:
        return []
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])  # earlier occurrences of the last token
    if not ends.size:
        return []
    length = np.ones(ends.size, dtype=np.int64)  # matched suffix length ending at each candidate
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, n_top):
        idx = ends - j
        alive &= idx >= 0
        alive[alive] = tokens[idx[alive]] == tokens[L - 1 - j]
        if not alive.any():
            break
        length += alive
    best = min(int(length.max()), n_top)
    if best < n_min:
        return []
    end = int(ends[np.flatnonzero(length >= best)[-1]])
    return tokens[end + 1: end + 1 + k].tolist()


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
