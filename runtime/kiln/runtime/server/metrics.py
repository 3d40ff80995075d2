"""Prometheus metrics, built from the torch-free table ``kiln.common.metrics.METRICS`` (names,
types, help texts, buckets and labels are spelled there once, for the server and the
operator).  ``kiln_request_queue_time_seconds`` (arrival to first scheduling) is the
autoscaling signal.

The registry lives in the engine core's process (it sees every step and every sequence,
whatever the number of API processes); the API processes add their counters through
``on_api_stats`` and read the text through the core's metrics socket.
"""

from __future__ import annotations

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kiln.common.metrics import METRICS, MODEL_NAME_LABEL, MetricSpec

_TYPES = {"histogram": Histogram, "gauge": Gauge, "counter": Counter}


def _build(spec: MetricSpec, registry: CollectorRegistry):
    """The ``prometheus_client`` metric of one table row, registered in ``registry``."""
    kwargs = {"buckets": spec.buckets} if spec.type == "histogram" else {}
    return _TYPES[spec.type](spec.name, spec.help, [MODEL_NAME_LABEL, *spec.labels], registry=registry, **kwargs)


class Metrics:
    """All of the server's metrics in their own registry; implements the engine core's
    ``StatLogger`` protocol.  ``model_name`` becomes the ``model_name`` label."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        built = {spec.name: _build(spec, self.registry) for spec in METRICS}
        self._built = built

        def one(name: str):  # the metric's child for this model (metrics without extra labels)
            return built[name].labels(model_name)

        self.queue_time = one("kiln_request_queue_time_seconds")
        self.grammar_time = one("kiln_request_grammar_compile_time_seconds")
        self.ttft = one("kiln_time_to_first_token_seconds")
        self.tpot = one("kiln_time_per_output_token_seconds")
        self.e2e = one("kiln_e2e_request_latency_seconds")
        self.prefill_time = one("kiln_request_prefill_time_seconds")
        self.decode_time = one("kiln_request_decode_time_seconds")
        self.running = one("kiln_num_requests_running")
        self.waiting = one("kiln_num_requests_waiting")
        self.kv_usage = one("kiln_kv_cache_usage_ratio")
        self.prompt_tokens = one("kiln_prompt_tokens_total")
        self.prompt_tokens_cached = one("kiln_prompt_tokens_cached_total")
        self.generation_tokens = one("kiln_generation_tokens_total")
        self.iteration_tokens = one("kiln_iteration_tokens")
        self.preemptions = one("kiln_num_preemptions_total")
        self.prefix_queries = one("kiln_prefix_cache_queries_total")
        self.prefix_hits = one("kiln_prefix_cache_hits_total")
        self.detokenize = one("kiln_detokenize_seconds_total")
        self.model_name = model_name
        self._last = {"preempt": 0, "queries": 0, "hits": 0}
        self._spec_last = None  # the last SpecDecodeStats counts seen (cumulative)
        self._proc = psutil.Process()

    # StatLogger
    def on_grammar_compiled(self, seconds: float) -> None:
        """A request's grammar compiled, ``seconds`` after its arrival (outside the queue time)."""
        self.grammar_time.observe(max(0.0, seconds))

    def on_scheduled(self, queue_seconds: float) -> None:
        """A request was scheduled for the first time, ``queue_seconds`` after its arrival."""
        self.queue_time.observe(max(0.0, queue_seconds))

    def on_first_token(self, ttft_seconds: float) -> None:
        """A request produced its first token ``ttft_seconds`` after its arrival."""
        self.ttft.observe(max(0.0, ttft_seconds))

    def on_finish(self, stats) -> None:
        """A request finished (``stats``: the core's ``FinishedStats``)."""
        self.e2e.observe(max(0.0, stats.finish_time - stats.arrival_time))
        if stats.first_scheduled_time is not None and stats.first_token_time is not None:
            self.prefill_time.observe(max(0.0, stats.first_token_time - stats.first_scheduled_time))
        if stats.first_token_time is not None:
            decode = max(0.0, stats.finish_time - stats.first_token_time)
            self.decode_time.observe(decode)
            if stats.num_generation_tokens > 1:  # the request's mean time per output token
                self.tpot.observe(decode / (stats.num_generation_tokens - 1))
        self._built["kiln_request_success_total"].labels(self.model_name, stats.finish_reason).inc()

    def on_step(self, stats) -> None:
        """One engine step (``stats``: the core's ``StepStats``): token counts and gauges.
        Sent twice per step: after planning (prompt tokens; the gauges hold during a long
        prefill) and after sampling (generated tokens)."""
        if stats.num_prompt_tokens > 0:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_scheduled_tokens > 0:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        if stats.num_cached_prompt_tokens > 0:
            self.prompt_tokens_cached.inc(stats.num_cached_prompt_tokens)
        if stats.num_generation_tokens > 0:
            self.generation_tokens.inc(stats.num_generation_tokens)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        for key, value, counter in (("preempt", stats.num_preemptions_total, self.preemptions),
                                    ("queries", stats.prefix_cache_queries, self.prefix_queries),
                                    ("hits", stats.prefix_cache_hits, self.prefix_hits)):
            if value > self._last[key]:
                counter.inc(value - self._last[key])
                self._last[key] = value
        if getattr(stats, "spec_decode", None) is not None:
            self._on_spec(stats.spec_decode)
        for bucket, rates in (getattr(stats, "spec_switch_off", None) or {}).items():
            for mode, rate in rates.items():
                if rate is not None:
                    self._built["kiln_spec_decode_output_tokens_per_second"].labels(
                        self.model_name, bucket, mode).set(rate)

    def _on_spec(self, spec) -> None:
        """Speculative decoding counters from the core's cumulative ``SpecDecodeStats``."""
        last = self._spec_last or (0, 0, 0, [], [])
        b = self._built
        m = self.model_name
        for (name, now), before in zip((("kiln_spec_decode_num_drafts_total", spec.num_drafts),
                                        ("kiln_spec_decode_num_draft_tokens_total", spec.num_draft_tokens),
                                        ("kiln_spec_decode_num_accepted_tokens_total", spec.num_accepted_tokens)),
                                       last[:3]):
            if now > before:
                b[name].labels(m).inc(now - before)
        for name, counts, before in (("kiln_spec_decode_num_draft_tokens_per_pos_total", spec.proposed_per_position,
                                      last[3]),
                                     ("kiln_spec_decode_num_accepted_tokens_per_pos_total",
                                      spec.accepted_per_position, last[4])):
            for i, n in enumerate(counts):
                prev = before[i] if i < len(before) else 0
                if n > prev:
                    b[name].labels(m, str(i)).inc(n - prev)
        if spec.num_drafts:
            b["kiln_spec_decode_acceptance_rate"].labels(m).set(spec.acceptance_rate)
            b["kiln_spec_decode_mean_accepted_length"].labels(m).set(spec.mean_accepted_length)
        self._spec_last = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                           list(spec.proposed_per_position), list(spec.accepted_per_position))

    def on_api_stats(self, stats) -> None:
        """An API process's counters (deltas) and resource use (``messages.ApiStats``)."""
        for reason, n in stats.failures.items():
            self._built["kiln_request_failure_total"].labels(self.model_name, reason).inc(n)
        if stats.detokenize_seconds > 0:
            self.detokenize.inc(stats.detokenize_seconds)
        self._process(stats.process, stats.cpu_seconds, stats.rss_bytes)

    def _process(self, label: str, cpu_seconds: float, rss_bytes: int) -> None:
        self._built["kiln_process_cpu_seconds"].labels(self.model_name, label).set(cpu_seconds)
        self._built["kiln_process_resident_memory_bytes"].labels(self.model_name, label).set(rss_bytes)

    def render(self) -> bytes:
        """The registry in the Prometheus text format (``GET /metrics``), with this (the
        core's) process's CPU and memory refreshed."""
        cpu = self._proc.cpu_times()
        self._process("core", cpu.user + cpu.system, self._proc.memory_info().rss)
        return generate_latest(self.registry)
