"""The served Prometheus metrics as data: one row per metric (name, type, help, buckets,
labels).

``kiln serve`` builds its ``prometheus_client`` metrics from ``METRICS``
(``kiln.runtime.server.metrics``); the operator's autoscaler and the chart's
prometheus-adapter rule read ``METRIC_REQUEST_QUEUE_TIME``.  Counter names carry the
``_total`` suffix as exposed (``prometheus_client`` strips it and adds it back on samples).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "METRIC_PREFIX",
    "METRIC_REQUEST_QUEUE_TIME",
    "MODEL_NAME_LABEL",
    "LATENCY_BUCKETS",
    "TOKEN_BUCKETS",
    "MetricSpec",
    "METRICS",
    "METRIC_NAMES",
    "metric",
]

METRIC_PREFIX = "kiln_"
METRIC_REQUEST_QUEUE_TIME = "kiln_request_queue_time_seconds"  # histogram; the autoscaling signal
MODEL_NAME_LABEL = "model_name"  # on every metric: the served model's name

# Histogram buckets in seconds: request latencies, and the time between two output tokens.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# Tokens computed by one engine step.
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class MetricSpec:
    """One served metric.

    Fields:
        name: the exposed name (prefix ``kiln_``; counters end in ``_total``).
        type: ``histogram``, ``gauge`` or ``counter``.
        help: the ``# HELP`` text.
        labels: label names besides ``model_name`` (which every metric has).
        buckets: histogram bucket upper bounds in the metric's unit; empty for other types.
    """

    name: str
    type: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(METRIC_REQUEST_QUEUE_TIME, "histogram", "Arrival to first scheduling, less the time its "
               "grammar compiled (seconds).", buckets=LATENCY_BUCKETS),
    MetricSpec("kiln_request_grammar_compile_time_seconds", "histogram",
               "Arrival to the structured-output grammar compiled (seconds; requests with a grammar).",
               buckets=LATENCY_BUCKETS),
    MetricSpec("kiln_time_to_first_token_seconds", "histogram", "Arrival to first token (seconds).",
               buckets=LATENCY_BUCKETS),
    MetricSpec("kiln_time_per_output_token_seconds", "histogram",
               "A request's mean time per output token after the first (seconds).",
               buckets=TOKEN_BUCKETS),
    MetricSpec("kiln_e2e_request_latency_seconds", "histogram", "Arrival to finish (seconds).",
               buckets=LATENCY_BUCKETS),
    MetricSpec("kiln_num_requests_running", "gauge", "Sequences in the running batch."),
    MetricSpec("kiln_num_requests_waiting", "gauge", "Sequences waiting to be scheduled."),
    MetricSpec("kiln_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use (0-1)."),
    MetricSpec("kiln_prompt_tokens_total", "counter", "Prompt tokens computed (prefill)."),
    MetricSpec("kiln_generation_tokens_total", "counter", "Tokens generated."),
    MetricSpec("kiln_num_preemptions_total", "counter", "Sequences preempted (recompute)."),
    MetricSpec("kiln_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache."),
    MetricSpec("kiln_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache."),
    MetricSpec("kiln_request_success_total", "counter", "Finished requests by reason.",
               labels=("finished_reason",)),
    MetricSpec("kiln_prompt_tokens_cached_total", "counter",
               "Prompt tokens served from the prefix cache instead of computed."),
    MetricSpec("kiln_request_prefill_time_seconds", "histogram",
               "First scheduling to first token: the prefill stage (seconds).", buckets=LATENCY_BUCKETS),
    MetricSpec("kiln_request_decode_time_seconds", "histogram",
               "First token to finish: the decode stage (seconds).", buckets=LATENCY_BUCKETS),
    MetricSpec("kiln_iteration_tokens", "histogram", "Tokens computed by one engine step (tokens).",
               buckets=ITERATION_BUCKETS),
    MetricSpec("kiln_request_failure_total", "counter",
               "Requests that failed, by reason (bad_request, not_found, unauthorized, too_large, timeout, "
               "client_gone, engine_error).", labels=("reason",)),
    MetricSpec("kiln_detokenize_seconds_total", "counter",
               "Time the API processes spent detokenizing and matching stop strings (seconds)."),
    MetricSpec("kiln_spec_decode_num_drafts_total", "counter",
               "Speculative decoding: sequence-steps that verified drafts."),
    MetricSpec("kiln_spec_decode_num_draft_tokens_total", "counter",
               "Speculative decoding: draft tokens proposed and verified."),
    MetricSpec("kiln_spec_decode_num_accepted_tokens_total", "counter",
               "Speculative decoding: draft tokens the model accepted."),
    MetricSpec("kiln_spec_decode_num_draft_tokens_per_pos_total", "counter",
               "Speculative decoding: drafts proposed at each draft position (0-based).", labels=("position",)),
    MetricSpec("kiln_spec_decode_num_accepted_tokens_per_pos_total", "counter",
               "Speculative decoding: drafts accepted at each draft position (0-based); over the proposed count "
               "it is the acceptance rate per position.", labels=("position",)),
    MetricSpec("kiln_spec_decode_acceptance_rate", "gauge",
               "Speculative decoding: accepted over proposed draft tokens since start (0-1)."),
    MetricSpec("kiln_spec_decode_mean_accepted_length", "gauge",
               "Speculative decoding: tokens per verifying sequence-step since start, accepted drafts + 1."),
    MetricSpec("kiln_spec_decode_output_tokens_per_second", "gauge",
               "Speculative decoding: output tokens per second measured by the switch-off per batch-size bucket "
               "(batch_sizes \"3-4\": steps of 3 or 4 sequences), with drafts (mode=speculative) and without "
               "(mode=plain); decayed, recent steps weigh most. Where both are measured the faster mode runs "
               "(unless a fixed --speculative-disable-by-batch-size is set).", labels=("batch_sizes", "mode")),
    MetricSpec("kiln_process_cpu_seconds", "gauge", "CPU time used by a server process, user + system (seconds).",
               labels=("process",)),
    MetricSpec("kiln_process_resident_memory_bytes", "gauge", "Resident memory of a server process (bytes).",
               labels=("process",)),
)

METRIC_NAMES = tuple(m.name for m in METRICS)

_BY_NAME = {m.name: m for m in METRICS}


def metric(name: str) -> MetricSpec:
    """The row of the metric called ``name``.  Raises ``KeyError`` for a name not served."""
    return _BY_NAME[name]
