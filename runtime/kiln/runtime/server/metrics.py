"""Prometheus metrics (prefix ``kiln_``; names in DESIGN.md).  ``kiln_request_queue_time_seconds``
(arrival to first scheduling) is the autoscaling signal."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    """All of the server's metrics in their own registry; implements the engine's
    ``StatLogger`` protocol.  ``model_name`` becomes the ``model_name`` label."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        r = self.registry
        self.queue_time = Histogram("kiln_request_queue_time_seconds", "Arrival to first scheduling (seconds).",
                                    lab, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Arrival to first token (seconds).",
                              lab, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("kiln_time_per_output_token_seconds", "Time between output tokens (seconds).",
                              lab, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Arrival to finish (seconds).",
                             lab, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.running = Gauge("kiln_num_requests_running", "Sequences in the running batch.", lab,
                             registry=r).labels(model_name)
        self.waiting = Gauge("kiln_num_requests_waiting", "Sequences waiting to be scheduled.", lab,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("kiln_kv_cache_usage_ratio", "Fraction of KV blocks in use (0-1).", lab,
                              registry=r).labels(model_name)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens computed (prefill).", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated.", lab,
                                         registry=r).labels(model_name)
        self.preemptions = Counter("kiln_num_preemptions", "Sequences preempted (recompute).", lab,
                                   registry=r).labels(model_name)
        self.prefix_queries = Counter("kiln_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      lab, registry=r).labels(model_name)
        self.prefix_hits = Counter("kiln_prefix_cache_hits", "Prompt tokens found in the prefix cache.", lab,
                                   registry=r).labels(model_name)
        self._success = Counter("kiln_request_success", "Finished requests by reason.", lab + ["finished_reason"],
                                registry=r)
        self.model_name = model_name
        self._last = {"preempt": 0, "queries": 0, "hits": 0}

    # StatLogger
    def on_scheduled(self, queue_seconds: float) -> None:
        self.queue_time.observe(max(0.0, queue_seconds))

    def on_first_token(self, ttft_seconds: float) -> None:
        self.ttft.observe(max(0.0, ttft_seconds))

    def on_token(self, itl_seconds: float) -> None:
        self.tpot.observe(max(0.0, itl_seconds))

    def on_finish(self, e2e_seconds: float, num_prompt_tokens: int, num_generation_tokens: int,
                  finish_reason: str) -> None:
        self.e2e.observe(max(0.0, e2e_seconds))
        self._success.labels(self.model_name, finish_reason).inc()

    def on_step(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        if num_prompt_tokens > 0:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens > 0:
            self.generation_tokens.inc(num_generation_tokens)

    def update_gauges(self, scheduler) -> None:
        """Refresh gauges and delta-counters from the scheduler (call after each step)."""
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(scheduler.kv_cache_usage)
        kv = scheduler.kv_cache_manager
        for key, value, counter in (("preempt", scheduler.num_preemptions_total, self.preemptions),
                                    ("queries", kv.prefix_cache_queries, self.prefix_queries),
                                    ("hits", kv.prefix_cache_hits, self.prefix_hits)):
            if value > self._last[key]:
                counter.inc(value - self._last[key])
                self._last[key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
