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
from ..model_runner import PendingStep, StepResult
from ..sampler import SamplingRow
from ..structured_output.manager import StructuredOutputManager
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


class StatLogger(Protocol):
    """Receives the core's per-sequence and per-step statistics (the server's Prometheus
    metrics implement it)."""

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
        # Structured output: grammar states, made at the first request with a grammar; such a
        # request waits in ``_awaiting_grammar`` (outside the scheduler) until it is compiled.
        self.structured: StructuredOutputManager | None = None
        self._awaiting_grammar: dict[str, Request] = {}
        self.num_steps = 0
        self.startup_seconds = lm.load_seconds + time.perf_counter() - t0

    # -- requests ------------------------------------------------------------------------
    def add_request(self, req: CoreRequest) -> None:
        """Queue one sequence.

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
            self._structured()  # no tokenizer: refused before an adapter slot is held
        if req.lora_name:
            r.lora_id = self._acquire_lora(req.lora_name)  # raises LoRAError (an InvalidRequestError)
        gen = None
        if req.seed is not None:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(req.seed)
        if spec is None:
            self.scheduler.add_request(r)
        else:  # queued once its grammar is compiled (``_admit_compiled``)
            self._structured().submit(req.request_id, spec)
            self._awaiting_grammar[req.request_id] = r
        self._seqs[req.request_id] = _Seq(r, req.params, gen, req.record_metrics)
        if req.params.has_penalties:
            self._num_history_requests += 1

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

    def _structured(self) -> StructuredOutputManager:
        if self.structured is None:
            tok = self.loaded.tokenizer
            if tok is None:
                raise InvalidRequestError("structured output needs the model's tokenizer; this model has none")
            self.structured = StructuredOutputManager(lambda: tok, self.model_config.vocab_size,
                                                      sorted(self.eos_token_ids),
                                                      pin_memory=self.runner.device.type == "cuda")
        return self.structured

    def _admit_compiled(self) -> list[CoreOutput]:
        """Queue the sequences whose grammar finished compiling; end (finish_reason "abort")
        those whose grammar failed.  With nothing else to run, waits up to 10 ms for a compile
        instead of spinning the step loop."""
        if not self._awaiting_grammar:
            return []
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
            self.structured.wait_any(0.01)
        ready, failed = self.structured.poll()
        for rid in ready:
            r = self._awaiting_grammar.pop(rid, None)
            if r is not None:
                self.scheduler.add_request(r)
        outs = []
        now = time.monotonic()
        for rid, msg in failed:
            self._awaiting_grammar.pop(rid, None)
            seq = self._seqs.pop(rid, None)
            if seq is None:
                continue
            log.error("request %s: its grammar does not compile in the engine core: %s", rid, msg)
            if seq.params.has_penalties:
                self._num_history_requests -= 1
            outs.append(CoreOutput(rid, [], finish_reason="abort"))
            self._release_lora(seq)
            self._record_finish(seq, now, "abort")
        return outs

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
            self._awaiting_grammar.pop(rid, None)
            if self.structured is not None:
                self.structured.free(rid)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
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
        outputs: list[CoreOutput] = self._admit_compiled()
        if not self.async_scheduling:
            out = self.scheduler.schedule()
            self._report_gauges(out)
            if not out.scheduled:
                return outputs
            fill = self.structured.fill_bitmask if self._has_grammar_rows(out) else None
            return outputs + self._process(out, self.runner.execute(out, self._sampling_rows(out), fill))
        if self._in_flight is not None and self._num_history_requests:
            outputs += self._drain()  # penalties read the previous token on the host
        out = self.scheduler.schedule()
        self._report_gauges(out)
        launched = None
        if out.scheduled:
            fill = None
            if self._has_grammar_rows(out):
                def fill(ids: list[str]):
                    # after this step's forward pass is launched: read the previous step's
                    # tokens, advance the grammars, fill this step's mask while the device runs
                    if self._in_flight is not None:
                        outputs.extend(self._drain())
                    return self.structured.fill_bitmask(ids)
            launched = (out, self.runner.execute_async(out, self._sampling_rows(out), fill))
        if self._in_flight is not None:
            outputs += self._drain()
        self._in_flight = launched
        return outputs

    def _has_grammar_rows(self, out: SchedulerOutput) -> bool:
        so = self.structured
        return so is not None and so.num_states > 0 and any(
            sr.needs_sample and so.has_grammar(sr.request.request_id) for sr in out.scheduled)

    def _drain(self) -> list[CoreOutput]:
        out, pending = self._in_flight
        self._in_flight = None
        return self._process(out, pending.result())

    def _report_gauges(self, out: SchedulerOutput) -> None:
        """Gauges right after planning, so they show a long prefill while it runs."""
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
                    self.stat_logger.on_scheduled(now - sr.request.arrival_time)
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
        self.scheduler.update_from_output(out, res.sampled)
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
            num_gen += 1
            outputs.append(self._on_token(seq, tok, res.logprobs.get(rid), now))
        if self.stat_logger is not None and num_gen:
            sched = self.scheduler
            kv = sched.kv_cache_manager
            self.stat_logger.on_step(StepStats(
                num_prompt_tokens=0, num_cached_prompt_tokens=0, num_generation_tokens=num_gen, num_scheduled_tokens=0,
                num_running=sched.num_running, num_waiting=sched.num_waiting, kv_cache_usage=sched.kv_cache_usage,
                num_preemptions_total=sched.num_preemptions_total, prefix_cache_queries=kv.prefix_cache_queries,
                prefix_cache_hits=kv.prefix_cache_hits))
        return outputs

    def _on_token(self, seq: _Seq, tok: int, lp, now: float) -> CoreOutput:
        params = seq.params
        req = seq.request
        if seq.first_token_time is None:
            if seq.record_metrics and self.stat_logger is not None:
                self.stat_logger.on_first_token(now - req.arrival_time)
            seq.first_token_time = now
        seq.last_token_time = now
        status, stop_reason = None, None
        num_out = req.num_real_output_tokens
        at_limit = num_out >= req.max_tokens or req.num_prompt_tokens + num_out >= self.max_model_len
        so = self.structured if params.structured_outputs is not None else None
        if so is not None and not so.accept(req.request_id, tok):  # the mask forbids this: a bug
            log.error("request %s: token %d is outside its grammar", req.request_id, tok)
            status = RequestStatus.FINISHED_ABORTED
        elif so is not None and so.is_terminated(req.request_id):
            status = RequestStatus.FINISHED_STOPPED  # the grammar ended (with ignore_eos too)
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
            if so is not None:
                so.free(req.request_id)
            self.scheduler.finish_request(req.request_id, status)
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
