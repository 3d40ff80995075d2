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
    # Token ids that must not be sampled this step (EOS and stop ids before min_tokens).
    banned_token_ids: list[int] | None = None


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
            big = torch.finfo(logits.dtype).max  # a tiny penalty must not overflow to inf (then NaN)
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                          vals * p.repetition_penalty).clamp(-big, big)
        if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row [V] (float32); returns probabilities."""
    logits = (logits / p.temperature).clamp_(max=torch.finfo(logits.dtype).max)  # finite after a tiny T
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


def _filter_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``_filter`` for R rows at once: float32 ``logits`` [R, V] -> probabilities [R, V].

    Row-wise the same operations as ``_filter`` (temperature, top-k as a threshold at the
    k-th largest logit, softmax, top-p over the sorted probabilities, min-p), with the
    per-row settings as [R] tensors, so a batch costs a fixed number of kernels instead of
    ~10 per row (vLLM's batched sampler does the same).  The sort for top-p and the top-k
    pass run only when some row asks for them, and only on those rows.
    """
    R, V = logits.shape
    dev = logits.device

    def col(values, dtype=torch.float32):  # [R, 1] on the device through pinned memory
        t = torch.tensor(values, dtype=dtype)
        return (t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t).unsqueeze(1)

    logits = (logits / col([p.temperature for p in params])).clamp_(max=torch.finfo(logits.dtype).max)
    ks = [p.top_k if p.top_k not in (-1, 0) and p.top_k < V else 0 for p in params]
    if any(ks):
        kmax = max(ks)
        top = torch.topk(logits, kmax, dim=-1).values  # [R, kmax], descending
        kth = top.gather(1, col([max(k, 1) - 1 for k in ks], torch.int64))  # [R, 1]
        kth = torch.where(col([k > 0 for k in ks], torch.bool), kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        idx = _index(p_rows, dev)
        sub = probs.index_select(0, idx)  # [P, V]
        sorted_p, order = torch.sort(sub, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop_sorted = (cum - sorted_p) > col([params[i].top_p for i in p_rows])
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs.index_copy_(0, idx, sub.masked_fill(drop, 0.0))
    if any(p.min_p > 0.0 for p in params):
        floor = col([p.min_p for p in params]) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


@dataclass
class DeviceSample:
    """The sampler's result before any host read: everything stays on the logits' device
    until :meth:`start_copy` moves it to pinned host memory without blocking, so the host
    can plan the next step while the device finishes this one.

    ``token_ids`` int64 [S]; for the ``lp_rows`` that asked for log-probabilities:
    ``lp_sampled`` float32 [R] (the sampled token's), ``lp_top_vals`` float32 [R, kmax] and
    ``lp_top_ids`` int64 [R, kmax] (top-k of the raw distribution; row r keeps its first
    ``lp_k[r]`` entries).
    """

    token_ids: torch.Tensor
    lp_rows: list[int]
    lp_k: list[int]
    lp_sampled: torch.Tensor | None = None
    lp_top_vals: torch.Tensor | None = None
    lp_top_ids: torch.Tensor | None = None

    def start_copy(self) -> "DeviceSample":
        """Start device -> pinned host copies on the current stream (no wait on CUDA; the
        caller records an event after this and waits on it before :meth:`materialize`)."""
        def host(t):
            if t is None or not t.is_cuda:
                return t
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            return h
        return DeviceSample(host(self.token_ids), self.lp_rows, self.lp_k, host(self.lp_sampled),
                            host(self.lp_top_vals), host(self.lp_top_ids))

    def materialize(self) -> SamplerOutput:
        """Host lists (synchronizes with the device when the tensors are still there)."""
        token_ids = self.token_ids.tolist()
        lps: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(token_ids)
        if self.lp_rows:
            sampled = self.lp_sampled.tolist()
            vals = self.lp_top_vals.tolist() if self.lp_top_vals is not None else None
            ids = self.lp_top_ids.tolist() if self.lp_top_ids is not None else None
            for r, (i, k) in enumerate(zip(self.lp_rows, self.lp_k)):
                top = list(zip(ids[r][:k], vals[r][:k])) if k and ids is not None else []
                lps[i] = (sampled[r], top)
        return SamplerOutput(token_ids, lps)


def _index(rows: list[int], dev: torch.device) -> torch.Tensor:
    """int64 index tensor on ``dev`` through pinned memory (no stream synchronization)."""
    t = torch.tensor(rows, dtype=torch.int64)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def _argmax_chunk(vocab: int) -> int:
    """The chunk length of ``greedy_argmax``'s first pass: the largest divisor of ``vocab`` in
    [128, 1024] (0 when there is none: one pass)."""
    return next((c for c in range(1024, 127, -1) if vocab % c == 0), 0)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for float32 ``[S, vocab]`` logits (int64 ``[S]``), in two passes on
    CUDA when S is small: the argmax of each ``vocab / C``-chunk, then of the chunks' maxima.
    torch's single-row reduction runs on a few blocks (H200: 28-35 us for a 128256-token row,
    1.5 % of a batch-1 int4 decode step); the chunked form spreads the row over the GPU.
    Ties and NaN resolve as ``argmax``: the first maximal index (a NaN counts as the maximum),
    because the first pass keeps each chunk's first maximum and the second the first chunk."""
    S, V = logits.shape
    c = _argmax_chunk(V)
    if not logits.is_cuda or S > 16 or c == 0 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    return _chunked_argmax(logits, c)


def _chunked_argmax(logits: torch.Tensor, c: int) -> torch.Tensor:
    """``greedy_argmax``'s two passes over contiguous ``[S, vocab]`` logits, ``vocab % c == 0``."""
    S, V = logits.shape
    chunks = logits.view(S, V // c, c)
    first = chunks.argmax(dim=-1)  # [S, V / C] index in its chunk
    best = chunks.gather(2, first.unsqueeze(-1)).squeeze(-1).argmax(dim=-1)  # [S] chunk
    return best * c + first.gather(1, best.unsqueeze(-1)).squeeze(-1)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set to -inf every logit whose bit is 0: one masked fill over the batch.

    Args:
        logits: float [S, V] (modified in place).
        bitmask: int32 [G, ceil(V/32)] on the logits' device; bit ``t % 32`` of word
            ``t // 32`` of a row is 1 when token t is allowed there (xgrammar's layout).
            Rows of all ones leave their logits alone.
        rows: int64 [G] on the logits' device, the logits row of each bitmask row (logits
            rows without one are not masked); None: bitmask row s is logits row s (G == S).
    Returns:
        ``logits``.

    Float32 logits on the CPU go through xgrammar's CPU kernel (the same result, without
    the [S, V] intermediates the device form builds).
    """
    S, V = logits.shape
    if rows is not None:  # the batch's bitmask: all ones where no grammar row lands
        full = torch.full((S, bitmask.shape[1]), -1, dtype=torch.int32, device=logits.device)
        bitmask = full.index_copy_(0, rows, bitmask)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar as xgr  # noqa: PLC0415

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=V,
                                        indices=rows.tolist() if rows is not None else None)
        return logits
    return mask_logits_by_bits(logits, bitmask)


def mask_logits_by_bits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``apply_token_bitmask``'s device form: float ``logits`` [S, V] (in place) and int32
    ``bitmask`` [S, ceil(V/32)] on one device, as elementwise kernels (unpack the bits to
    [S, V], one masked fill)."""
    S, V = logits.shape
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(S, -1)[:, :V]  # [S, V] of 0/1
    return logits.masked_fill_(allowed == 0, float("-inf"))


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow], token_bitmask: torch.Tensor | None = None,
                     bitmask_rows: torch.Tensor | None = None) -> DeviceSample:
    """Pick one token per row without reading anything back to the host.

    Args:
        logits: float32 [S, vocab] (modified in place).
        rows: S sampling rows, aligned with ``logits``.
        token_bitmask: int32 [G, ceil(vocab/32)] on the logits' device, or None: the
            grammars' allowed tokens (``apply_token_bitmask``), applied after the penalties,
            logit bias and min_tokens ban, before greedy and sampling (vLLM's order).
        bitmask_rows: int64 [G] on the device, the row of each bitmask row (None: G == S, in
            order).
    Returns:
        A :class:`DeviceSample` (token ids int64 [S] on the logits' device).
    """
    S = logits.shape[0]
    dev = logits.device
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if lp_rows else None
    if any(r.params.has_penalties for r in rows):
        logits = _apply_penalties(logits, rows)
    for i, r in enumerate(rows):  # OpenAI's logit_bias, after the raw logprobs (as vLLM)
        if r.params.logit_bias:
            ids = _index(list(r.params.logit_bias), dev)
            vals = torch.tensor(list(r.params.logit_bias.values()), dtype=logits.dtype)
            vals = vals.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else vals
            logits[i].index_add_(0, ids, vals)

    banned = [(i, t) for i, r in enumerate(rows) for t in (r.banned_token_ids or ()) if 0 <= t < logits.shape[-1]]
    if banned:  # min_tokens: after the raw logprobs, before greedy and sampling (vLLM's order)
        idx = _index([i * logits.shape[-1] + t for i, t in banned], dev)
        logits.view(-1).index_fill_(0, idx, float("-inf"))
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask, bitmask_rows)
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        chosen = greedy_argmax(logits)
    else:
        chosen = torch.empty(S, dtype=torch.int64, device=dev)
        g_idx = [i for i in range(S) if greedy[i]]
        if g_idx:
            gi = _index(g_idx, dev)
            chosen[gi] = logits[gi].argmax(dim=-1)
        # Rows with their own seeded generator draw one by one (their tokens must not depend
        # on the batch); the others are filtered and drawn together.
        free = [i for i in range(S) if not greedy[i] and rows[i].generator is None]
        if free:
            fi = _index(free, dev)
            probs = _filter_batch(logits.index_select(0, fi), [rows[i].params for i in free])
            q = torch.empty_like(probs).exponential_()
            chosen[fi] = (probs / q).argmax(dim=-1)
        for i in range(S):
            if greedy[i] or rows[i].generator is None:
                continue
            probs = _filter(logits[i], rows[i].params)
            q = torch.empty_like(probs).exponential_(generator=rows[i].generator)
            chosen[i] = (probs / q).argmax()

    out = DeviceSample(chosen, lp_rows, [rows[i].params.logprobs or 0 for i in lp_rows])
    if lp_rows:
        idx = _index(lp_rows, dev)
        sel = raw_logprobs.index_select(0, idx)  # [R, V]
        out.lp_sampled = sel.gather(1, chosen.index_select(0, idx).unsqueeze(1)).squeeze(1)
        kmax = max(out.lp_k)
        if kmax:
            out.lp_top_vals, out.lp_top_ids = torch.topk(sel, kmax, dim=-1)
    return out


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """Pick one token per row and read the choices back (synchronizes with the device).

    Args:
        logits: float32 [S, vocab] (modified in place).
        rows: S sampling rows, aligned with ``logits``.
    Returns:
        SamplerOutput with S token ids (and log-probabilities where asked).
    """
    return sample_on_device(logits, rows).materialize()
