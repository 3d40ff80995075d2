"""Prometheus metrics, built from the torch-free table ``kiln.common.metrics.METRICS`` (names,
types, help texts, buckets and labels are spelled there once, for the server and the
operator).  ``kiln_request_queue_time_seconds`` (arrival to first scheduling) is the
autoscaling signal."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kiln.common.metrics import METRICS, MODEL_NAME_LABEL, MetricSpec

_TYPES = {"histogram": Histogram, "gauge": Gauge, "counter": Counter}


def _build(spec: MetricSpec, registry: CollectorRegistry):
    """The ``prometheus_client`` metric of one table row, registered in ``registry``."""
    kwargs = {"buckets": spec.buckets} if spec.type == "histogram" else {}
    return _TYPES[spec.type](spec.name, spec.help, [MODEL_NAME_LABEL, *spec.labels], registry=registry, **kwargs)


class Metrics:
    """All of the server's metrics in their own registry; implements the engine's
    ``StatLogger`` protocol.  ``model_name`` becomes the ``model_name`` label."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        built = {spec.name: _build(spec, self.registry) for spec in METRICS}

        def one(name: str):  # the metric's child for this model (metrics without extra labels)
            return built[name].labels(model_name)

        self.queue_time = one("kiln_request_queue_time_seconds")
        self.ttft = one("kiln_time_to_first_token_seconds")
        self.tpot = one("kiln_time_per_output_token_seconds")
        self.e2e = one("kiln_e2e_request_latency_seconds")
        self.running = one("kiln_num_requests_running")
        self.waiting = one("kiln_num_requests_waiting")
        self.kv_usage = one("kiln_kv_cache_usage_ratio")
        self.prompt_tokens = one("kiln_prompt_tokens_total")
        self.generation_tokens = one("kiln_generation_tokens_total")
        self.preemptions = one("kiln_num_preemptions_total")
        self.prefix_queries = one("kiln_prefix_cache_queries_total")
        self.prefix_hits = one("kiln_prefix_cache_hits_total")
        self._success = built["kiln_request_success_total"]  # labelled per finish by finished_reason
        self.model_name = model_name
        self._last = {"preempt": 0, "queries": 0, "hits": 0}

    # StatLogger
    def on_scheduled(self, queue_seconds: float) -> None:
        """A request was scheduled for the first time, ``queue_seconds`` after its arrival."""
        self.queue_time.observe(max(0.0, queue_seconds))

    def on_first_token(self, ttft_seconds: float) -> None:
        """A request produced its first token ``ttft_seconds`` after its arrival."""
        self.ttft.observe(max(0.0, ttft_seconds))

    def on_token(self, itl_seconds: float) -> None:
        """A request produced another token, ``itl_seconds`` after its previous one."""
        self.tpot.observe(max(0.0, itl_seconds))

    def on_finish(self, e2e_seconds: float, num_prompt_tokens: int, num_generation_tokens: int,
                  finish_reason: str) -> None:
        """A request finished (``finish_reason``: stop, length, abort...)."""
        self.e2e.observe(max(0.0, e2e_seconds))
        self._success.labels(self.model_name, finish_reason).inc()

    def on_step(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """One engine step computed these prompt tokens and generated these tokens."""
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
        """The registry in the Prometheus text format (``GET /metrics``)."""
        return generate_latest(self.registry)
