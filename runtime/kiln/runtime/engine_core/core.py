"""The engine core: scheduler -> model runner -> sampler, one step at a time, on token ids.

No tokenizer work happens here (the input and output processors do it); the core decides
the token-level endings (EOS, stop token ids, ``max_tokens``, the context) and reports each
step's new tokens as :class:`CoreOutput`.  It runs in its own process behind
:mod:`.proc` for ``kiln serve``, and in-process inside ``LLMEngine`` for the offline ``LLM``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import EngineArgs
from ..core.config import SchedulerConfig
from ..core.request import Request, RequestStatus
from ..core.sched_output import SchedulerOutput
from ..core.scheduler import Scheduler
from ..errors import InvalidRequestError
from ..sampler import SamplingRow
from ..step_result import PendingStep, StepResult
from .grammar_admission import GrammarAdmission
from .loading import LoadedModel, load_model
from .messages import CoreOutput, CoreRequest

log = logging.getLogger(__name__)


@dataclass
class FinishedStats:
    """Timings (monotonic seconds) and counts of one finished sequence, for metrics."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    finish_reason: str


@dataclass
class StepStats:
    """One step, for metrics: tokens computed (prompt tokens, of which ``num_cached`` were
    served by the prefix cache at admission), tokens generated, and the scheduler's state."""

    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generation_tokens: int
    num_scheduled_tokens: int  # tokens computed by the step (prefill chunks + decodes)
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode: object = None  # speculative decoding's cumulative counts (``SpecDecodeStats``; None: off)
    spec_switch_off: dict | None = None  # its measured output tok/s per batch-size bucket (``SwitchOff.rates``)


class StatLogger(Protocol):
    """Receives the core's per-sequence and per-step statistics (the server's Prometheus
    metrics implement it)."""

    def on_grammar_compiled(self, seconds: float) -> None: ...
    def on_scheduled(self, queue_seconds: float) -> None: ...
    def on_first_token(self, ttft_seconds: float) -> None: ...
    def on_finish(self, stats: FinishedStats) -> None: ...
    def on_step(self, stats: StepStats) -> None: ...


@dataclass
class _Seq:
    """The core's record of one sequence beside the scheduler's :class:`Request`."""

    request: Request
    params: object  # SamplingParams
    generator: torch.Generator | None
    record_metrics: bool
    first_token_time: float | None = None
    last_token_time: float = 0.0
    scheduled_logged: bool = False
    finished: bool = False
    grammar_seconds: float = 0.0  # arrival to grammar compiled: not queue time
    num_cached_reported: int = 0


class EngineCore:
    """Owns the model runner and the scheduler.

    Args:
        args: engine settings.
        stat_logger: optional metrics sink.
        loaded: an already loaded model (tests); default: ``load_model(args)``.
    Raises:
        ModelSourceError, UnsupportedModelError, ValueError: bad model or settings.
    """

    def __init__(self, args: EngineArgs, stat_logger: StatLogger | None = None, loaded: LoadedModel | None = None):
        t0 = time.perf_counter()
        if args.speculative is not None:
            args.speculative.check_sources()  # before the target's load
        lm = loaded or load_model(args)
        self.loaded = lm
        self.args = args = lm.args
        self.model_config = lm.model_config
        self.runner = lm.runner
        self.max_model_len = lm.max_model_len
        self.stat_logger = stat_logger
        # asynchronous scheduling pays only where the forward pass runs on a device stream
        self.async_scheduling = (args.async_scheduling if args.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens, 1),
            max_model_len=self.max_model_len,
            block_size=args.block_size,
            num_kv_blocks=self.runner.num_kv_blocks,
            policy=args.scheduler_policy,
            enable_prefix_caching=args.enable_prefix_caching,
            async_scheduling=self.async_scheduling,
            max_loras=args.max_loras if self.runner.lora is not None else 0,
        ))
        self.eos_token_ids = set(lm.eos_token_ids)
        # The step launched last, not yet read back: (its plan, its pending result).
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        # Live sequences whose sampling reads their own history (penalties): while any is
        # present, steps run synchronously so the history holds no placeholder.
        self._num_history_requests = 0
        self._seqs: dict[str, _Seq] = {}
        # Structured output: a request with a grammar waits there (outside the scheduler)
        # until its grammar is compiled; the grammar states and each step's bitmask.
        self.grammars = GrammarAdmission(lm.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
                                         self.runner.device.type == "cuda", args.grammar_compile_timeout)
        self.num_steps = 0
        # Speculative decoding (``args.speculative``): proposer, statistics; None: off.
        self.spec = None
        if args.speculative is not None:
            from ..spec_decode.decoder import SpecDecoder  # noqa: PLC0415

            self.spec = SpecDecoder.create(args.speculative, lm)
        self.startup_seconds = lm.load_seconds + time.perf_counter() - t0

    # -- requests ------------------------------------------------------------------------
    def add_request(self, req: CoreRequest) -> bool:
        """Queue one sequence; False when it waits for its grammar to compile first (its
        verdict comes later, from ``take_admissions``).

        Raises:
            InvalidRequestError: a duplicate id, or the scheduler cannot ever run it (nothing
                is queued).
        """
        if req.request_id in self._seqs:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}")
        r = Request(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                    max_tokens=req.max_tokens, arrival_time=req.arrival_time)
        try:
            self.scheduler.check_request(r)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        spec = None
        if req.params.structured_outputs is not None:
            try:
                spec = req.params.structured_outputs.spec()
            except ValueError as e:
                raise InvalidRequestError(str(e)) from e
            self.grammars.require()  # no tokenizer: refused before an adapter slot is held
        if req.lora_name:
            r.lora_id = self._acquire_lora(req.lora_name)  # raises LoRAError (an InvalidRequestError)
        gen = None
        if req.seed is not None:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(req.seed)
        if spec is None:
            self.scheduler.add_request(r)
        else:  # queued once its grammar is compiled (``_admit_compiled``)
            self.grammars.submit(r, spec)
        self._seqs[req.request_id] = _Seq(r, req.params, gen, req.record_metrics)
        if req.params.has_penalties:
            self._num_history_requests += 1
        return spec is None

    def take_admissions(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The sequences that waited for their grammar and got a verdict since the last call:
        ``(admitted ids, [(id, why refused)])`` (a refused one is gone, nothing to abort)."""
        return self.grammars.take()

    def _acquire_lora(self, name: str) -> int:
        lora = self.runner.lora
        if lora is None:
            from ..lora import LoRAError  # noqa: PLC0415

            raise LoRAError(f"the model {name!r} does not exist (this engine serves no LoRA adapters: start it "
                            "with --enable-lora or --lora-modules)", "NotFound")
        return lora.acquire(name)

    def _release_lora(self, seq: _Seq) -> None:
        if seq.request.lora_id and self.runner.lora is not None:
            self.runner.lora.release(seq.request.lora_id)

    def _admit_compiled(self) -> None:
        """Queue the sequences whose grammar finished compiling; drop those refused."""
        idle = not self.scheduler.has_unfinished_requests() and self._in_flight is None
        self.grammars.admit(self.scheduler, self._seqs, self.stat_logger, self._drop_unscheduled, idle)

    def _drop_unscheduled(self, request_id: str) -> _Seq | None:
        """Forget a sequence that never reached the scheduler (its grammar was refused)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            if seq.params.has_penalties:
                self._num_history_requests -= 1
            self._release_lora(seq)
        return seq

    def abort_requests(self, request_ids: list[str], finish_reason: str = "abort") -> None:
        """Drop sequences now (their KV blocks are freed); unknown or finished ids are
        ignored.  ``finish_reason`` is what the metrics record ("abort", or "stop" for a
        stop string found by the output processor)."""
        now = time.monotonic()
        for rid in request_ids:
            seq = self._seqs.pop(rid, None)
            if seq is None:
                continue
            if seq.params.has_penalties:
                self._num_history_requests -= 1
            self.grammars.discard(rid)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if self.spec is not None:
                self.spec.free(rid)
            self._release_lora(seq)
            self._record_finish(seq, now, finish_reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs) or self._in_flight is not None

    def report_stats(self) -> None:
        """Send the scheduler's gauges to the stat logger now (after admissions and aborts
        between steps, so an idle engine's gauges do not keep the last step's values)."""
        if self.stat_logger is None:
            return
        sched = self.scheduler
        kv = sched.kv_cache_manager
        self.stat_logger.on_step(StepStats(
            num_prompt_tokens=0, num_cached_prompt_tokens=0, num_generation_tokens=0, num_scheduled_tokens=0,
            num_running=sched.num_running, num_waiting=sched.num_waiting, kv_cache_usage=sched.kv_cache_usage,
            num_preemptions_total=sched.num_preemptions_total, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits))

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Run one scheduling step; returns the sequences that got tokens.

        With asynchronous scheduling this plans and launches step N, then reads back step
        N-1 while step N runs on the device; the outputs returned are step N-1's.
        """
        if self.spec is not None:  # meters the step for the speculation switch-off
            self.spec.switch_off.before_step(idle=not self.scheduler.num_running and self._in_flight is None)
        return self._step()

    def _step(self) -> list[CoreOutput]:  # one step of ``step``
        start = time.monotonic()
        self.runner.launch_deferred(if_ready=True)  # step N-1's sampler, if its grammar mask is done
        self._admit_compiled()
        outputs: list[CoreOutput] = []
        if self.spec is not None:
            num_running = self.scheduler.num_running
            if self.spec.active(num_running, self.scheduler.running, self._params_of):
                return outputs + self._spec_step(num_running)
            self.spec.switch_off.begin(False, num_running, start)
        if not self.async_scheduling:
            out = self.scheduler.schedule()
            self._report_gauges(out)
            if not out.scheduled:
                return outputs
            mask = self.grammars.start_fill(out)  # filled while the forward pass runs
            return outputs + self._process(out, self.runner.execute(out, self._sampling_rows(out),
                                                                    (lambda: mask) if mask is not None else None))
        if self._in_flight is not None and self._num_history_requests:
            outputs += self._drain()  # penalties read the previous token on the host
        out = self.scheduler.schedule()
        self._report_gauges(out)
        launched = None
        if out.scheduled:
            kw = {}
            if self.grammars.has_rows(out):
                # after this step's forward pass is launched: read the previous step back (its
                # tokens advance the grammars), start this step's fill; the sampler waits for
                # it before the next step's forward pass
                def read_back() -> None:
                    if self._in_flight is not None:
                        outputs.extend(self._drain())
                kw = {"grammar_mask": self.grammars.mask_after(out, read_back), "defer_sample": True}
            launched = (out, self.runner.execute_async(out, self._sampling_rows(out), **kw))
        if self._in_flight is not None:
            outputs += self._drain()
        self._in_flight = launched
        return outputs

    def _params_of(self, request_id: str):
        return self._seqs[request_id].params if request_id in self._seqs else None

    def _spec_step(self, num_running: int) -> list[CoreOutput]:
        """One synchronous step with drafts (speculative decoding): read back the step in
        flight, propose, plan, fill model drafts, verify."""
        outputs = self._drain() if self._in_flight is not None else []
        start = time.monotonic()  # the read-back belonged to the plain steps
        self.spec.plan(self.scheduler.running, self._params_of)
        out = self.scheduler.schedule(async_step=False)
        self.spec.on_planned(out, num_running, start)
        self._report_gauges(out)
        for rid in out.preempted_request_ids:
            self.spec.free(rid)
        if not out.scheduled:
            return outputs
        rows = self._sampling_rows(out)
        probs = self.spec.fill(out, rows)
        mask = self.grammars.start_fill(out)  # the drafts in place; filled while the forward pass runs
        res = self.runner.execute(out, rows, (lambda: mask) if mask is not None else None, probs)
        return outputs + self._process(out, res)

    def _drain(self) -> list[CoreOutput]:
        out, pending = self._in_flight
        self._in_flight = None
        return self._process(out, pending.result())

    def _report_gauges(self, out: SchedulerOutput) -> None:
        """Gauges right after planning, so they show a long prefill while it runs (and the
        speculation switch-off leaves a step with a prefill chunk unmeasured)."""
        if self.spec is not None:
            self.spec.on_planned(out)
        if self.stat_logger is None:
            return
        # prompt tokens computed this step (prefill chunks; a decode computes a generated
        # token) and those the prefix cache served at admission
        num_prompt = num_cached = num_scheduled = 0
        now = time.monotonic()
        for sr in out.scheduled:
            num_scheduled += sr.num_new_tokens
            if sr.is_decode:
                continue
            num_prompt += sr.num_new_tokens
            num_cached += sr.num_cached_tokens
            seq = self._seqs.get(sr.request.request_id)
            if seq is not None and not seq.scheduled_logged:
                seq.scheduled_logged = True
                if seq.record_metrics:
                    self.stat_logger.on_scheduled(now - sr.request.arrival_time - seq.grammar_seconds)
        sched = self.scheduler
        kv = sched.kv_cache_manager
        self.stat_logger.on_step(StepStats(
            num_prompt_tokens=num_prompt, num_cached_prompt_tokens=num_cached, num_generation_tokens=0,
            num_scheduled_tokens=num_scheduled,
            num_running=sched.num_running, num_waiting=sched.num_waiting, kv_cache_usage=sched.kv_cache_usage,
            num_preemptions_total=sched.num_preemptions_total, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits))

    def _sampling_rows(self, out: SchedulerOutput) -> dict[str, SamplingRow]:
        rows: dict[str, SamplingRow] = {}
        for sr in out.scheduled:
            if not sr.needs_sample:
                continue
            req = sr.request
            seq = self._seqs[req.request_id]
            params = seq.params
            hist = req.output_token_ids
            if params.has_penalties and req.num_output_placeholders:
                hist = hist[: req.num_real_output_tokens]
            banned = None
            if params.min_tokens:
                # tokens generated before the one sampled now (async scheduling has already
                # appended this step's placeholder)
                before = len(req.output_token_ids) - (1 if self.scheduler.config.async_scheduling else 0)
                if before < params.min_tokens:
                    banned = list(params.stop_token_ids)
                    if not params.ignore_eos:
                        banned += sorted(self.eos_token_ids)
            rows[req.request_id] = SamplingRow(params, req.prompt_token_ids, hist, seq.generator, banned)
        return rows

    def _process(self, out: SchedulerOutput, res: StepResult) -> list[CoreOutput]:
        """Apply a finished step: scheduler update, token-level stop checks, outputs."""
        if out.num_spec_tokens:
            self.spec.cut_at_stops(out, res, self._params_of, self.eos_token_ids)
        self.scheduler.update_from_output(out, res.sampled)
        if self.spec is not None and out.num_spec_tokens:
            self.spec.on_verified(out, res.num_accepted)
        self.num_steps += 1
        now = time.monotonic()
        outputs: list[CoreOutput] = []
        num_gen = 0
        for sr in out.scheduled:
            rid = sr.request.request_id
            tok = res.sampled.get(rid)
            seq = self._seqs.get(rid)
            if tok is None or seq is None or seq.request is not sr.request or seq.finished:
                continue  # no sample this step, or aborted (or its id reused) while in flight
            if isinstance(tok, list):  # a verified run (speculative decoding)
                num_gen += len(tok)
                outputs.append(self._on_run(seq, tok, res.logprobs.get(rid), now))
                continue
            num_gen += 1
            outputs.append(self._on_token(seq, tok, res.logprobs.get(rid), now))
        if self.spec is not None:
            self.spec.switch_off.add_tokens(num_gen)
        if self.stat_logger is not None and num_gen:
            sched = self.scheduler
            kv = sched.kv_cache_manager
            self.stat_logger.on_step(StepStats(
                num_prompt_tokens=0, num_cached_prompt_tokens=0, num_generation_tokens=num_gen, num_scheduled_tokens=0,
                num_running=sched.num_running, num_waiting=sched.num_waiting, kv_cache_usage=sched.kv_cache_usage,
                num_preemptions_total=sched.num_preemptions_total, prefix_cache_queries=kv.prefix_cache_queries,
                prefix_cache_hits=kv.prefix_cache_hits, spec_decode=self.spec.stats if self.spec else None,
                spec_switch_off=self.spec.switch_off.rates() if self.spec else None))
        return outputs

    def _on_run(self, seq: _Seq, run: list[int], lps, now: float) -> CoreOutput:
        """A verified run of tokens, already appended to the request: the stop checks token
        by token (as if each had come from its own step), one output for all of them."""
        total = seq.request.num_real_output_tokens
        merged = None
        for j, tok in enumerate(run):
            o = self._on_token(seq, tok, lps[j] if lps else None, now, num_out=total - len(run) + 1 + j)
            if merged is None:
                merged = o
            else:
                merged.new_token_ids += o.new_token_ids
                if merged.new_logprobs is not None and o.new_logprobs is not None:
                    merged.new_logprobs += o.new_logprobs
                merged.finish_reason, merged.stop_reason = o.finish_reason, o.stop_reason
            if seq.finished:
                break
        return merged

    def _on_token(self, seq: _Seq, tok: int, lp, now: float, num_out: int | None = None) -> CoreOutput:
        """One new token: stop checks, the sequence's end, its output.  ``num_out``: tokens
        generated up to and including this one (default: all the request holds)."""
        params = seq.params
        req = seq.request
        if seq.first_token_time is None:
            if seq.record_metrics and self.stat_logger is not None:
                self.stat_logger.on_first_token(now - req.arrival_time)
            seq.first_token_time = now
        seq.last_token_time = now
        status, stop_reason = None, None
        num_out = req.num_real_output_tokens if num_out is None else num_out
        at_limit = num_out >= req.max_tokens or req.num_prompt_tokens + num_out >= self.max_model_len
        grammar = params.structured_outputs is not None
        if grammar:
            status = self.grammars.check_token(req.request_id, tok)
        if status is not None:  # refused by its grammar (a bug: the mask forbids it) or the grammar complete
            pass
        elif num_out < params.min_tokens:  # EOS and stop ids are masked until min_tokens
            if at_limit:
                status = RequestStatus.FINISHED_LENGTH
        elif not params.ignore_eos and tok in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif tok in params.stop_token_ids:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, tok
        elif at_limit:
            status = RequestStatus.FINISHED_LENGTH
        first_sched = None
        if seq.num_cached_reported == 0:
            first_sched = req.first_scheduled_time
            seq.num_cached_reported = 1
        out = CoreOutput(req.request_id, [tok], [lp] if lp is not None and params.logprobs is not None else None,
                         num_cached_tokens=req.num_cached_tokens, first_scheduled_time=first_sched)
        if status is not None:
            out.finish_reason, out.stop_reason = status.finish_reason, stop_reason
            seq.finished = True
            if grammar:
                self.grammars.discard(req.request_id)
            self.scheduler.finish_request(req.request_id, status)
            if self.spec is not None:
                self.spec.free(req.request_id)
            self._seqs.pop(req.request_id, None)
            if params.has_penalties:
                self._num_history_requests -= 1
            self._release_lora(seq)
            self._record_finish(seq, now, status.finish_reason)
        return out

    def _record_finish(self, seq: _Seq, now: float, reason: str) -> None:
        if self.stat_logger is None or not seq.record_metrics:
            return
        r = seq.request
        self.stat_logger.on_finish(FinishedStats(
            arrival_time=r.arrival_time, first_scheduled_time=r.first_scheduled_time,
            first_token_time=seq.first_token_time, finish_time=now, num_prompt_tokens=r.num_prompt_tokens,
            num_cached_tokens=r.num_cached_tokens, num_generation_tokens=r.num_real_output_tokens,
            finish_reason=reason))
