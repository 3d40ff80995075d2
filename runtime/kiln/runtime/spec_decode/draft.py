"""Draft-model proposer: a smaller model with the target's tokenizer guesses ``k`` tokens.

Any model Kiln loads can be the draft (a builtin, a GGUF, a Hugging Face folder, or a
``kiln build`` engine folder, e.g. an int4 engine of the target itself).  The draft has its
own KV pool with as many blocks as the target's and writes it through the *target's* block
tables and slot mapping (vLLM's EAGLE proposer shares the block table the same way), so the
scheduler's allocation, prefix caching and rollback cover both models.

Per step, after scheduling: each sequence's draft KV catches up from its first position the
draft has not computed (the whole prompt at first, then the one or two tokens verified since)
in one forward, whose last row gives the first draft; ``k - 1`` one-token forwards give the
others.  Greedy sequences take the draft's argmax; sampled ones draw from the draft's
filtered distribution ``q`` (the target's temperature, top-k, top-p, min-p), which the
rejection sampler needs.  After verification the draft's computed length is cut back to the
target's verified length (its KV for rejected drafts is stale); a preempted sequence starts
over.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..core.sched_output import ScheduledRequest, SchedulerOutput
from ..sampler import _filter_batch, _index

log = logging.getLogger(__name__)

#: Most token ids (a share of the vocabulary) whose strings may differ between a draft model's
#: tokenizer and the target's (renamed special tokens) before the draft is refused.
MAX_DIFFERING_TOKENS = 0.01


def tokens_that_differ(a, b) -> int:
    """How many token ids the transformers tokenizers ``a`` and ``b`` spell differently (an id
    one has and the other lacks counts); 0 when either is None (token ids only)."""
    if a is None or b is None:
        return 0
    ia = {i: t for t, i in a.get_vocab().items()}
    ib = {i: t for t, i in b.get_vocab().items()}
    return sum(ia.get(i) != ib.get(i) for i in ia.keys() | ib.keys())


def draft_engine_args(target_args, source: str):
    """The draft model's ``EngineArgs``: the target's device, dtype, KV pool and context,
    with the draft's source (an engine folder or a model), no LoRA, no speculation, and
    decode CUDA graphs (when the target has them) up to the batch size that still drafts."""
    from pathlib import Path  # noqa: PLC0415

    is_engine = (Path(source) / "manifest.json").is_file()
    spec = target_args.speculative
    drafting = None if spec is None else min(spec.max_batch_size, target_args.max_num_seqs or spec.max_batch_size)
    return replace(target_args, model=None if is_engine else source, engine=source if is_engine else None,
                   enable_lora=False, lora_modules={}, lora_modules_file=None,
                   speculative_method=None, num_speculative_tokens=None, speculative_model=None,
                   prompt_lookup_min=None, prompt_lookup_max=None, speculative_disable_by_batch_size=None,
                   max_num_seqs=drafting, max_num_batched_tokens=None,
                   load_format="auto" if is_engine else target_args.load_format,
                   quantization="none" if is_engine else target_args.quantization)


class DraftModelProposer:
    """Drafts from a second model over the target's block tables.

    Args:
        k: drafts per sequence and step (tokens).
        runner: the draft's ``ModelRunner`` (weights loaded, KV pool of the target's size).
    """

    #: drafts are made after scheduling, in the KV slots the scheduler reserved
    needs_model = True

    def __init__(self, k: int, runner):
        self.k = k
        self.runner = runner
        self.block_size = runner.block_size
        # request id -> (positions whose draft KV is valid (tokens), the request's
        # num_preemptions when they were computed)
        self._state: dict[str, tuple[int, int]] = {}

    @classmethod
    def load(cls, config, target) -> "DraftModelProposer":
        """Load ``config.model`` beside the target (``target``: its ``LoadedModel``).

        Raises:
            ValueError: the draft's vocabulary differs from the target's, or its context is
                shorter than the target's served context.
        """
        from ..engine_core.loading import load_model  # noqa: PLC0415

        args = draft_engine_args(target.args, config.model)
        args = replace(args, num_kv_blocks=target.runner.num_kv_blocks, max_model_len=target.max_model_len)
        # catch-up forwards of up to k + 1 tokens per sequence (the tokens verified since the
        # last step) replay multi-token graphs; the first, over a whole prompt, runs eagerly
        try:
            draft = load_model(args, catch_up_rows=config.num_speculative_tokens + 1)
        except ValueError as e:  # e.g. a context shorter than the target's served one
            raise ValueError(f"speculative model {config.model}: {e}") from None
        if draft.model_config.vocab_size != target.model_config.vocab_size:
            raise ValueError(f"speculative model {config.model}: its vocabulary has {draft.model_config.vocab_size} "
                             f"tokens, the target's {target.model_config.vocab_size}; a draft model must share the "
                             "target's tokenizer")
        differ = tokens_that_differ(draft.tokenizer, target.tokenizer)
        if differ > MAX_DIFFERING_TOKENS * target.model_config.vocab_size:
            raise ValueError(f"speculative model {config.model}: {differ} of its {draft.model_config.vocab_size} "
                             "token ids spell other tokens than the target's; a draft model must share the target's "
                             "tokenizer")
        if differ:
            log.warning("speculative model %s: %d token ids spell other tokens than the target's (special tokens?); "
                        "drafts of those tokens will be rejected", config.model, differ)
        log.info("draft model %s loaded for speculative decoding (%d drafts per step)", draft.model_ref,
                 config.num_speculative_tokens)
        return cls(config.num_speculative_tokens, draft.runner)

    # -- state ------------------------------------------------------------------------------
    def _computed(self, req) -> int:
        st = self._state.get(req.request_id)
        if st is None or st[1] != req.num_preemptions:  # new, or its blocks were freed since
            return 0
        return st[0]

    def on_verified(self, out: SchedulerOutput, num_accepted: dict[str, int]) -> None:
        """Cut each sequence's draft KV back to the target's verified tokens."""
        for sr in out.scheduled:
            st = self._state.get(sr.request.request_id)
            if st is not None:
                self._state[sr.request.request_id] = (min(st[0], sr.request.num_computed_tokens), st[1])

    def free(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    # -- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, rows: dict) -> dict[str, torch.Tensor]:
        """Write the drafts of every scheduled sequence that has draft slots into its
        ``spec_token_ids``; returns the draft distributions of sampled sequences (float32
        [k, V] by request id)."""
        srs = [sr for sr in out.scheduled if sr.num_spec_tokens]
        if not srs:
            return {}
        bs = self.block_size
        # 1. catch-up: every position from the first the draft lacks to the last known token
        ids, pos, slots, seq_lens, q_lens, tables, starts, runs = [], [], [], [], [], [], [], []
        for sr in srs:
            req, n = sr.request, sr.num_tokens
            start = min(self._computed(req), n - 1)
            runs.append(req.token_slice(start, n))
            ids += runs[-1]
            starts.append(start)
            pos += range(start, n)
            slots += [sr.block_ids[p // bs] * bs + p % bs for p in range(start, n)]
            seq_lens.append(n)
            q_lens.append(n - start)
            tables.append(sr.block_ids)
        last = [sum(q_lens[: i + 1]) - 1 for i in range(len(srs))]
        graphs = self.runner.decode_graphs
        hidden = None
        if graphs is not None and any(q > 1 for q in q_lens):
            hidden = graphs.run_verify_rows(runs, starts, tables)
        if hidden is not None:
            logits = self.runner.model.compute_logits(hidden.index_select(0, self.runner.h2d(last, torch.int64)))
        else:
            logits = self._forward(ids, pos, slots, seq_lens, q_lens, tables, last)
        probs: dict[str, list[torch.Tensor]] = {}
        tok = self._pick(logits, srs, rows, probs)  # int64 [R] on the device
        # 2. one token at a time for the other drafts; the drafts stay on the device (each
        # forward reads the last one there) and are read back once, at the end
        cols = [(list(range(len(srs))), tok)]
        for j in range(1, max(sr.num_spec_tokens for sr in srs)):
            live = [i for i, sr in enumerate(srs) if sr.num_spec_tokens > j]
            sub = [srs[i] for i in live]
            prev = last_drafts(cols, live, self.runner)
            p = [sr.num_tokens + j - 1 for sr in sub]  # the position of draft j (0-based: j-1)
            logits = self._forward(prev, p, [sr.block_ids[q // bs] * bs + q % bs for sr, q in zip(sub, p)],
                                   [q + 1 for q in p], [1] * len(sub), [sr.block_ids for sr in sub],
                                   list(range(len(sub))))
            cols.append((live, self._pick(logits, sub, rows, probs)))
        read_back_drafts(cols, srs)
        for sr in srs:
            # the draft wrote KV up to the position before its last draft
            self._state[sr.request.request_id] = (sr.num_tokens + len(sr.spec_token_ids) - 1,
                                                  sr.request.num_preemptions)
        return {rid: torch.stack(ps) for rid, ps in probs.items()}

    def _forward(self, ids, pos, slots, seq_lens, q_lens, tables, logit_rows) -> torch.Tensor:
        """The draft's logits (float32 [len(logit_rows), V]) over rows of token ``ids`` (a
        host list, or int64 on the device) at positions ``pos``."""
        r = self.runner
        num_decodes = len(q_lens) if all(q == 1 for q in q_lens) else 0
        hidden = r.decode_graphs.run_rows(ids, list(pos), tables) \
            if num_decodes and r.decode_graphs is not None else None
        if hidden is None:
            meta = r.attention_metadata(slots, seq_lens, q_lens, tables, num_decodes)
            ids_t = ids if torch.is_tensor(ids) else r.h2d(ids, torch.int64)
            hidden = r.model(ids_t, r.h2d(list(pos), torch.int64), meta)
        if len(logit_rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, r.h2d(logit_rows, torch.int64))
        return r.model.compute_logits(hidden)

    def _pick(self, logits: torch.Tensor, srs: list[ScheduledRequest], rows: dict,
              probs: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """The next draft per row: argmax for greedy sequences, else a draw from the filtered
        draft distribution (kept in ``probs`` for the rejection sampler)."""
        params = [rows[sr.request.request_id].params for sr in srs]
        tok = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            idx = _index(sampled, logits.device)
            q = _filter_batch(logits.index_select(0, idx), [params[i] for i in sampled])
            e = torch.empty_like(q)
            for r, i in enumerate(sampled):
                gen = rows[srs[i].request.request_id].generator
                e[r].exponential_(generator=gen)
            tok.index_copy_(0, idx, (q / e).argmax(dim=-1))
            for r, i in enumerate(sampled):
                probs.setdefault(srs[i].request.request_id, []).append(q[r])
        return tok


def last_drafts(cols: list[tuple[list[int], torch.Tensor]], live: list[int], runner) -> torch.Tensor:
    """The latest drafts (int64 on the device) of the rows ``live``, a subset of the rows
    ``cols[-1][0]`` that ``cols[-1][1]`` holds them for (``runner.h2d`` stages the gather)."""
    rows, drafts = cols[-1]
    if len(live) == len(rows):
        return drafts
    at = {r: k for k, r in enumerate(rows)}
    return drafts.index_select(0, runner.h2d([at[i] for i in live], torch.int64))


def read_back_drafts(cols: list[tuple[list[int], torch.Tensor]], srs: list[ScheduledRequest]) -> None:
    """Write the drafts into each sequence's ``spec_token_ids`` with one device read:
    ``cols[j]`` holds draft ``j`` (int64 on the device) of the rows ``cols[j][0]``."""
    flat = torch.cat([t for _, t in cols]).tolist()
    drafts: list[list[int]] = [[] for _ in srs]
    r = 0
    for live, _ in cols:
        for i in live:
            drafts[i].append(flat[r])
            r += 1
    for sr, d in zip(srs, drafts):
        sr.spec_token_ids[:] = d
