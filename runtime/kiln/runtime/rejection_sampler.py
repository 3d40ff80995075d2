"""Verification of draft tokens (speculative decoding) as a sampler step.

A sequence that verifies ``k`` drafts ``d_1..d_k`` has ``k + 1`` logits rows: the target's
distributions ``p_0..p_k`` after its last known token and after each draft.  The result is the
longest accepted prefix ``d_1..d_a`` and one more token of the target's: its correction at
the first rejected position, or a bonus token from ``p_k`` when all drafts are accepted.

* Greedy rows accept ``d_j`` while it is the argmax of ``p_{j-1}``; the extra token is that
  argmax.  The output is token for token what decoding without drafts gives.
* Sampled rows use rejection sampling (Leviathan et al., 2023, "Fast Inference from
  Transformers via Speculative Decoding"; Chen et al., 2023, "Accelerating Large Language
  Model Decoding with Speculative Sampling"): accept ``d_j`` with probability
  ``min(1, p(d_j) / q(d_j))``; at the first rejection draw from ``max(0, p - q)``
  normalised.  ``q`` is the draft's distribution, or a point mass at ``d_j`` for a
  deterministic proposer (n-gram), where the test is ``u < p(d_j)`` and the residual is
  ``p`` without ``d_j``.  Every output token is then distributed exactly as the target's
  sampler would draw it; ``p`` is the distribution after temperature, top-k, top-p, min-p
  and logit bias (``sampler._filter_batch``), as the sampler without drafts uses.

Draws use the exponential race (``argmax(w / Exp(1))`` samples ``w`` unnormalised), with the
request's seeded generator when it has one, so seeded outputs are reproducible.
Log-probabilities are those of the raw distribution (as the sampler's).  One host read per
step; every row of a step is verified in a fixed number of kernels except seeded rows, which
draw one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import SamplingRow, _filter_batch, _index, apply_token_bitmask, greedy_argmax, sample_on_device


@dataclass
class VerifyResult:
    """Per sequence: the verified run of tokens and, where asked, a log-probability entry
    ``(sampled logprob, [(token id, logprob), ...top-k])`` per token."""

    token_ids: list[list[int]]
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]
    num_accepted: list[int]


@dataclass
class DeviceVerify:
    """The verification before its host read (``materialize``).

    Per logits row t (``T = sum(k_i + 1)`` rows): ``candidate`` int64 [T], the target's
    token at that position (argmax, residual draw or bonus draw); ``accept`` bool [T],
    whether the draft at that position (if any) is accepted.  ``lp_*``: the raw
    log-probabilities of the drafts and candidates [T] and the top-k [T, kmax] (None when no
    row asked).
    """

    drafts: list[list[int]]
    candidate: torch.Tensor
    accept: torch.Tensor
    lp_k: list[int | None]
    lp_draft: torch.Tensor | None = None
    lp_cand: torch.Tensor | None = None
    lp_top_vals: torch.Tensor | None = None
    lp_top_ids: torch.Tensor | None = None

    def materialize(self) -> VerifyResult:
        """Host lists: accepted prefix + the target's token per sequence."""
        cand = self.candidate.tolist()
        acc = self.accept.tolist()
        lp_d = self.lp_draft.tolist() if self.lp_draft is not None else None
        lp_c = self.lp_cand.tolist() if self.lp_cand is not None else None
        top_v = self.lp_top_vals.tolist() if self.lp_top_vals is not None else None
        top_i = self.lp_top_ids.tolist() if self.lp_top_ids is not None else None
        tokens, lps, num_acc = [], [], []
        row = 0
        for drafts, k in zip(self.drafts, self.lp_k):
            a = 0
            while a < len(drafts) and acc[row + a]:
                a += 1
            tokens.append(list(drafts[:a]) + [cand[row + a]])
            num_acc.append(a)
            if k is None:
                lps.append(None)
            else:
                entries = []
                for j in range(a + 1):
                    r = row + j
                    top = list(zip(top_i[r][:k], top_v[r][:k])) if k and top_i is not None else []
                    entries.append((lp_d[r] if j < a else lp_c[r], top))
                lps.append(entries)
            row += len(drafts) + 1
        return VerifyResult(tokens, lps, num_acc)


class MixedVerify:
    """A step's plain samples (``sampler.DeviceSample``, sequences without drafts) and
    verifications (:class:`DeviceVerify`) read back together: ``materialize`` lists the
    plain sequences first (one token each), then the verified ones (a run each)."""

    def __init__(self, plain, verify: DeviceVerify | None):
        self.plain, self.verify = plain, verify

    def materialize(self) -> VerifyResult:
        tokens: list = []
        lps: list = []
        if self.plain is not None:
            res = self.plain.materialize()
            tokens += res.token_ids
            lps += res.logprobs
        num_acc: list[int] = []
        if self.verify is not None:
            res = self.verify.materialize()
            tokens += res.token_ids
            lps += res.logprobs
            num_acc = res.num_accepted
        # plain sequences have no acceptance entry: align the list with the spec sequences
        return VerifyResult(tokens, lps, [None] * (len(tokens) - len(num_acc)) + num_acc)


def verify_on_device(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
                     draft_probs: list[torch.Tensor | None] | None = None,
                     token_bitmask: torch.Tensor | None = None,
                     bitmask_rows: torch.Tensor | None = None) -> DeviceVerify:
    """Verify every sequence's drafts without a host read.

    Args:
        logits: float32 [T, V], ``T = sum(len(d) + 1 for d in drafts)``; sequence i's rows are
            contiguous, in ``rows`` order (modified in place).
        rows: one sampling row per sequence (no penalties or banned ids: the engine proposes
            no drafts for such sequences).
        drafts: the draft token ids per sequence (may be empty: plain sampling).
        draft_probs: per sequence None (point-mass drafts) or float32 [len(d), V], the
            draft model's distribution each draft was drawn from.
        token_bitmask: int32 [G, ceil(V/32)] on the device: the grammars' legal tokens at
            the logits rows ``bitmask_rows`` (int64 [G]; None: G == T in order), applied after
            the raw log-probabilities and the logit bias, before the acceptance tests, so the
            target distribution verified against is the constrained one (a draft outside its
            grammar has probability 0 there and is rejected).
    Returns:
        A :class:`DeviceVerify`.
    Raises:
        ValueError: when ``T`` does not match the drafts.
    """
    T, V = logits.shape
    dev = logits.device
    counts = [len(d) + 1 for d in drafts]
    if sum(counts) != T or len(rows) != len(drafts):
        raise ValueError(f"verify: {T} logits rows for {len(drafts)} sequences with {sum(counts)} positions")
    # draft at each row (the token that row's distribution judges); -1 on bonus rows
    nxt = [t for d in drafts for t in list(d) + [-1]]
    lp_wanted = [rows[i].params.logprobs is not None for i in range(len(rows))]
    raw = torch.log_softmax(logits, dim=-1) if any(lp_wanted) else None
    for i, r in enumerate(rows):  # OpenAI's logit_bias, after the raw logprobs (as the sampler)
        if r.params.logit_bias:
            start = sum(counts[:i])
            ids = _index(list(r.params.logit_bias), dev)
            vals = torch.tensor(list(r.params.logit_bias.values()), dtype=logits.dtype).to(dev)
            logits[start:start + counts[i]].index_add_(1, ids, vals.unsqueeze(0).expand(counts[i], -1))
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask, bitmask_rows)
    nxt_t = _index([max(t, 0) for t in nxt], dev)
    candidate = greedy_argmax(logits)
    accept = candidate == nxt_t
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        _rejection_rows(logits, rows, drafts, draft_probs, counts, sampled, candidate, accept, nxt_t)
    out = DeviceVerify(drafts, candidate, accept, [rows[i].params.logprobs if lp_wanted[i] else None
                                                   for i in range(len(rows))])
    if raw is not None:
        out.lp_draft = raw.gather(1, nxt_t.unsqueeze(1)).squeeze(1)
        out.lp_cand = raw.gather(1, candidate.unsqueeze(1)).squeeze(1)
        kmax = max((k or 0) for k in out.lp_k if k is not None)
        if kmax:
            out.lp_top_vals, out.lp_top_ids = torch.topk(raw, kmax, dim=-1)
    return out


def _rejection_rows(logits, rows, drafts, draft_probs, counts, sampled, candidate, accept, nxt_t) -> None:
    """Rejection sampling for the non-greedy sequences ``sampled``: overwrite their rows of
    ``candidate`` (residual draws; bonus draws on the last row) and ``accept``."""
    dev = logits.device
    starts = [sum(counts[:i]) for i in range(len(counts))]
    row_idx = [starts[i] + j for i in sampled for j in range(counts[i])]
    idx = _index(row_idx, dev)
    probs = _filter_batch(logits.index_select(0, idx), [rows[i].params for i in sampled for _ in range(counts[i])])
    # q: the draft distribution per row (point mass at the draft when the proposer gives none;
    # zero on bonus rows, whose residual is then p itself)
    q = torch.zeros_like(probs)
    point_rows, point_toks, dist_rows, dists = [], [], [], []
    pos = 0
    for i in sampled:
        k = counts[i] - 1
        dp = draft_probs[i] if draft_probs is not None else None
        if dp is not None:
            dist_rows.extend(range(pos, pos + k))
            dists.append(dp)
        else:
            point_rows.extend(range(pos, pos + k))
            point_toks.extend(drafts[i])
        pos += counts[i]
    if point_rows:
        q.index_put_((_index(point_rows, dev), _index(point_toks, dev)), torch.ones((), dtype=q.dtype, device=dev))
    if dist_rows:
        q.index_copy_(0, _index(dist_rows, dev), torch.cat(dists).to(q.dtype))
    d = nxt_t.index_select(0, idx).unsqueeze(1)
    p_d = probs.gather(1, d).squeeze(1)
    q_d = q.gather(1, d).squeeze(1)
    residual = (probs - q).clamp_(min=0.0)
    # p == q leaves no residual mass (a rejection then has probability 0): draw from p
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)
    u = torch.rand(p_d.shape, dtype=p_d.dtype, device=dev)
    e = torch.empty_like(residual).exponential_()
    pos = 0
    for i in sampled:
        gen = rows[i].generator
        if gen is not None:  # the request's own stream: its draws do not depend on the batch
            n = counts[i]
            u[pos:pos + n].uniform_(generator=gen)
            e[pos:pos + n].exponential_(generator=gen)
        pos += counts[i]
    ok = u * q_d < p_d  # u < p/q without dividing by a zero q
    candidate.index_copy_(0, idx, (residual / e).argmax(dim=-1))
    accept.index_copy_(0, idx, ok)


def verify_step(runner, out, logits: torch.Tensor, ids: list[str], rows: dict[str, SamplingRow], draft_probs: dict,
                grammar_mask=None) -> tuple[list[str], MixedVerify]:
    """The sampling of a step that verifies drafts: sequences with drafts through
    :func:`verify_on_device`, the others (no drafts: penalties, prefill ends...) through the
    plain sampler; ``grammar_mask`` (a ``structured_output.bitmask.GrammarMask``) holds a
    row per plain sequence with a grammar and a row per position of each verifying one.

    Args:
        runner: the ``ModelRunner`` (device, host-to-device copies).
        out: the step's ``SchedulerOutput``; logits: float32 [T, V], the sampling rows of
            ``ids`` in order (``k + 1`` rows for a sequence with ``k`` drafts).
        rows: sampling settings by id; draft_probs: draft distributions by id (absent: point
            mass).
    Returns:
        ``(ids in result order, MixedVerify)``: plain ids first (one token each), then the
        verified ones (a run each).
    """
    by_id = {sr.request.request_id: sr for sr in out.scheduled}
    spec_rows: list[int] = []
    plain_rows: list[int] = []
    spec_ids: list[str] = []
    plain_ids: list[str] = []
    r = 0
    for rid in ids:
        n = by_id[rid].num_spec_tokens + 1
        if n > 1:
            spec_ids.append(rid)
            spec_rows.extend(range(r, r + n))
        else:
            plain_ids.append(rid)
            plain_rows.append(r)
        r += n
    ds = dv = None
    if plain_ids:
        bitmask = mask_rows = None
        if grammar_mask is not None and grammar_mask.request_ids:
            bitmask, mask_rows = runner.mask_on_device(grammar_mask, plain_ids)
        ds = sample_on_device(logits.index_select(0, runner.h2d(plain_rows, torch.int64)),
                              [rows[i] for i in plain_ids], bitmask, mask_rows)
    if spec_ids:
        drafts = [list(by_id[i].spec_token_ids) for i in spec_ids]
        sub = logits if not plain_ids else logits.index_select(0, runner.h2d(spec_rows, torch.int64))
        bitmask = mask_rows = None
        if grammar_mask is not None and any(i in grammar_mask.draft_rows for i in spec_ids):
            bitmask, mask_rows = runner.draft_mask_on_device(grammar_mask, spec_ids, [len(d) + 1 for d in drafts])
        dv = verify_on_device(sub, [rows[i] for i in spec_ids], drafts, [draft_probs.get(i) for i in spec_ids],
                              bitmask, mask_rows)
    return plain_ids + spec_ids, MixedVerify(ds, dv)
