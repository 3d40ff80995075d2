"""The engine core's side of speculative decoding: which sequences get drafts, from which
proposer, and what the verification did (counts for ``/metrics`` and ``kiln bench``).

Per step, while at most ``SpeculativeConfig.max_batch_size`` sequences run and speculation
pays at this batch size (``switch_off.SwitchOff``: output tokens per second with and without
drafts, measured as the engine runs):

1. ``plan``: before scheduling, each decoding sequence that may speculate gets
   ``request.spec_token_ids``: the n-gram proposer's drafts, or placeholders for a
   model-based proposer (the scheduler then reserves their KV slots).
2. the scheduler plans a synchronous step, taking the drafts into decode steps.
3. ``fill``: a model-based proposer writes its drafts into the scheduled requests (it runs
   its model over the target's block tables) and returns its draft distributions.
4. the target verifies (``ModelRunner``/``rejection_sampler``); ``on_verified`` counts.

A sequence speculates unless its sampling reads its own history or bans tokens per step:
repetition / presence / frequency penalties, ``min_tokens`` not reached yet (the sampler bans
EOS per step).  Those decode one token per step beside the others.  A sequence with a grammar
speculates: its bitmask has a row per position, filled by advancing the grammar over the
drafts (``structured_output.bitmask.fill_draft_rows``), and the verification masks each
position's logits, so a draft the grammar refuses is rejected and every kept token is legal.
"""

from __future__ import annotations

import logging

from ..core.request import PLACEHOLDER_TOKEN_ID, Request
from ..core.sched_output import SchedulerOutput
from .config import SpeculativeConfig
from .ngram import NgramProposer
from .stats import SpecDecodeStats
from .switch_off import SwitchOff

log = logging.getLogger(__name__)


class SpecDecoder:
    """Owns the proposer and the statistics of one engine core.

    Args:
        config: the speculative settings.
        proposer: ``NgramProposer`` or a model-based proposer (``DraftModelProposer``,
            ``EagleProposer``) with ``propose(out, rows)`` and ``on_verified``/``free``.
    """

    def __init__(self, config: SpeculativeConfig, proposer):
        self.config = config
        self.proposer = proposer
        self.stats = SpecDecodeStats()
        # below max_batch_size: measured unless the user fixed the size
        self.switch_off = SwitchOff(config.max_batch_size, adaptive=config.disable_by_batch_size is None)
        # steps run with speculation on / off (the batch too large, or drafts not paying) (counts)
        self.num_spec_steps = 0
        self.num_disabled_steps = 0
        self.seeded_only = False  # this step drafts for the seeded sampled sequences only

    @classmethod
    def create(cls, config: SpeculativeConfig, loaded) -> "SpecDecoder":
        """The decoder for ``config`` next to the target ``loaded`` (a ``LoadedModel``).

        Raises:
            ValueError / ModelSourceError: a draft model or head that cannot serve this
                target (another vocabulary, an unreadable checkpoint).
        """
        k = config.num_speculative_tokens
        if config.method == "ngram":
            return cls(config, NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max))
        if config.method == "draft":
            from .draft import DraftModelProposer  # noqa: PLC0415

            return cls(config, DraftModelProposer.load(config, loaded))
        from .eagle import EagleProposer  # noqa: PLC0415

        return cls(config, EagleProposer.load(config, loaded))

    def active(self, num_running: int, running: list[Request], params_of) -> bool:
        """Whether this step speculates: at most ``max_batch_size`` running sequences and,
        unless ``disable_by_batch_size`` was given, drafts measured to pay at this batch size.

        Where the measured rule says no, a step still speculates for the seeded sampled
        sequences among ``running`` (``params_of(request_id)``: their SamplingParams), and only
        for those (``seeded_only``): rejection sampling draws other random numbers than plain
        sampling, and a seed must give the same tokens whatever the timing of the steps."""
        on = self.switch_off.decide(num_running)
        self.seeded_only = False
        if not on and 0 < num_running <= self.config.max_batch_size \
                and any(self._seeded_sampling(params_of(r.request_id)) for r in running):
            on = self.seeded_only = True
        if not on and num_running:
            self.num_disabled_steps += 1
        return on

    def on_planned(self, out: SchedulerOutput, num_running: int = 0, start: float | None = None) -> None:
        """Meter a planned step: a speculative step (``start``: when its interval began, after
        reading back the step in flight) is a sample of the speculative mode, drafts or not,
        unless it drafts for the seeded sequences only; a step with a prefill chunk is a
        sample of neither mode."""
        if start is not None:
            self.switch_off.begin(True, num_running, start)
        if self.seeded_only or any(not sr.is_decode for sr in out.scheduled):
            self.switch_off.discard()

    @staticmethod
    def _seeded_sampling(params) -> bool:
        return params is not None and params.seed is not None and not params.greedy

    @staticmethod
    def eligible(req: Request, params) -> bool:
        """A decoding sequence whose sampling allows drafts (see the module docstring)."""
        return (req.num_tokens - req.num_computed_tokens == 1 and not req.num_output_placeholders
                and not params.has_penalties
                and req.num_output_tokens >= params.min_tokens
                and req.num_output_tokens + 1 < req.max_tokens)

    def plan(self, running: list[Request], params_of) -> int:
        """Set ``spec_token_ids`` of the running sequences that speculate this step;
        ``params_of(request_id)`` gives a sequence's SamplingParams (None: unknown).
        Returns the drafts set (tokens; placeholders count)."""
        k = self.config.num_speculative_tokens
        total = 0
        for req in running:
            params = params_of(req.request_id)
            if params is None or not self.eligible(req, params) \
                    or (self.seeded_only and not self._seeded_sampling(params)):
                req.spec_token_ids = []
                continue
            kk = min(k, req.max_tokens - req.num_output_tokens - 1)
            if self.proposer.needs_model:
                req.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * kk
            else:
                req.spec_token_ids = self.proposer.propose(req.all_token_ids, kk)
            total += len(req.spec_token_ids)
        return total

    def fill(self, out: SchedulerOutput, rows: dict) -> dict:
        """Model-based proposers write the scheduled drafts (in place) and return their
        distributions per request id (float32 [k, V]; {} for greedy rows and n-gram)."""
        self.num_spec_steps += 1
        if not self.proposer.needs_model or not out.num_spec_tokens:
            return {}
        return self.proposer.propose(out, rows)

    def on_verified(self, out: SchedulerOutput, num_accepted: dict[str, int]) -> None:
        """Count a verify step's outcome and let the proposer drop state of rejected drafts."""
        for sr in out.scheduled:
            a = num_accepted.get(sr.request.request_id)
            if sr.num_spec_tokens and a is not None:
                self.stats.observe(sr.num_spec_tokens, a)
        if self.proposer.needs_model:
            self.proposer.on_verified(out, num_accepted)

    @staticmethod
    def cut_at_stops(out: SchedulerOutput, res, params_of, eos_token_ids: set[int]) -> None:
        """Cut each verified run of ``res`` (a ``StepResult``) after its first EOS (unless
        ``ignore_eos``) or stop token id, in place, so the scheduler appends and computes only
        the tokens the sequence keeps."""
        for sr in out.scheduled:
            rid = sr.request.request_id
            run = res.sampled.get(rid)
            params = params_of(rid)
            if not isinstance(run, list) or params is None:
                continue
            for j, tok in enumerate(run):
                if (not params.ignore_eos and tok in eos_token_ids) or tok in params.stop_token_ids:
                    del run[j + 1:]
                    lp = res.logprobs.get(rid)
                    if isinstance(lp, list):
                        del lp[j + 1:]
                    break

    def free(self, request_id: str) -> None:
        """A sequence finished or was preempted: its proposer state goes."""
        if self.proposer.needs_model:
            self.proposer.free(request_id)
