"""Turns a batch of logits into next tokens, per-row settings, without a host sync beyond
reading the chosen ids.

Order of operations (vLLM's): log-probabilities are taken from the raw logits; then
repetition / presence / frequency penalties; then greedy rows take the argmax, the others
apply temperature, top-k, top-p (Holtzman et al., 2020) and min-p (Nguyen et al., 2024) and
draw with the exponential-race trick (``argmax(p / Exp(1))`` is a sample from ``p``), with
a per-request ``torch.Generator`` when the request has a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the batch to sample: its settings, history and RNG."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # seeded requests only


@dataclass
class SamplerOutput:
    """``token_ids``: chosen ids (host list, one per row).  ``logprobs``: per row either None
    or ``(sampled_logprob, [(token_id, logprob), ...top-k])`` from the raw distribution."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        out_ids = torch.tensor(row.output_token_ids, dtype=torch.int64, device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                                dtype=torch.int64, device=logits.device)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row [V] (float32); returns probabilities."""
    logits = logits / p.temperature
    if p.top_k not in (-1, 0) and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop_sorted = (cum - sorted_p) > p.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """Pick one token per row.

    Args:
        logits: float32 [S, vocab] (modified in place).
        rows: S sampling rows, aligned with ``logits``.
    Returns:
        SamplerOutput with S token ids (and log-probabilities where asked).
    """
    S = logits.shape[0]
    want_lp = [r.params.logprobs is not None for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    if any(r.params.has_penalties for r in rows):
        logits = _apply_penalties(logits, rows)

    greedy = [r.params.greedy for r in rows]
    chosen = torch.empty(S, dtype=torch.int64, device=logits.device)
    g_idx = [i for i in range(S) if greedy[i]]
    if len(g_idx) == S:
        chosen = logits.argmax(dim=-1)
    elif g_idx:
        gi = torch.tensor(g_idx, device=logits.device)
        chosen[gi] = logits[gi].argmax(dim=-1)
    for i in range(S):
        if greedy[i]:
            continue
        probs = _filter(logits[i], rows[i].params)
        q = torch.empty_like(probs).exponential_(generator=rows[i].generator)
        chosen[i] = (probs / q).argmax()

    token_ids = chosen.tolist()
    lps: list[tuple[float, list[tuple[int, float]]] | None] = [None] * S
    if raw_logprobs is not None:
        for i in range(S):
            if not want_lp[i]:
                continue
            k = rows[i].params.logprobs or 0
            sampled = float(raw_logprobs[i, token_ids[i]])
            top: list[tuple[int, float]] = []
            if k:
                vals, idx = torch.topk(raw_logprobs[i], k)
                top = list(zip(idx.tolist(), vals.tolist()))
            lps[i] = (sampled, top)
    return SamplerOutput(token_ids, lps)
