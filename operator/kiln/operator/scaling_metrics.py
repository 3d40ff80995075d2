"""The signals an InferenceEngine can autoscale on (``spec.autoscaling.metric``), as data.

Each row names the served metric, how its value is read, and the target used when
``autoscaling.target`` is not set.  Most come from the serving pods (``source`` ``engine``: the
runtime's ``kiln.common.metrics.METRICS``, what ``kiln serve`` exposes on ``/metrics``); one
comes from the Kiln router (``source`` ``router``: ``kiln_router_queue_requests{namespace,
engine, model}``, the requests it holds or has in flight for the engine, ``kiln.operator.router.
metrics``).  The same table drives the three consumers, so they cannot disagree on a name:

- the HPA (mode ``hpa``): for an engine signal a Pods metric named ``series``, served by
  prometheus-adapter through the chart's ``rules.custom`` (helm/kiln/templates/
  prometheus-adapter-rule.yaml), target ``AverageValue``; for the router's queue an External
  metric of the chart's ``rules.external`` selected by ``engine``, target ``AverageValue`` (the
  HPA divides the engine's total by its replicas);
- the KEDA ScaledObject (mode ``keda``): a ``prometheus`` trigger whose query is ``promql``
  (``metricType: Value`` for a per-pod mean, ``AverageValue`` for the router's total);
- the builtin autoscaler (mode ``builtin``): the pods' ``/metrics`` scraped by the operator, or
  the router pods' ``/metrics`` for the router's queue.

Histograms are read as the mean of the observations between two reads (``_sum`` rate over
``_count`` rate); gauges as their current value.  Every engine signal is a per-pod average that
grows with load, which is what the HPA's ``ceil(replicas * value / target)`` needs; the router's
queue is the engine's total, which the consumers divide by the replicas (``ceil(total /
target)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.common.metrics import METRIC_NAMES, METRIC_REQUEST_QUEUE_TIME

#: The router's per-engine queue (held plus in-flight requests): kiln.operator.router.metrics.
ROUTER_QUEUE_SERIES = "kiln_router_queue_requests"

__all__ = ["ScalingMetric", "SCALING_METRICS", "DEFAULT_METRIC", "scaling_metric", "promql"]


@dataclass(frozen=True)
class ScalingMetric:
    """One autoscaling signal.

    Fields:
        name: the value of ``spec.autoscaling.metric``.
        series: the runtime metric (histogram or gauge) and the custom-metrics API name.
        kind: ``histogram`` (mean per observation over a window) or ``gauge`` (current value).
        unit: the unit of the target (``seconds``, ``ratio`` 0-1, ``requests``).
        default_target: the per-pod target when ``autoscaling.target`` is not set.
        pod_reduce: how one pod's series are combined (``sum`` over label sets, ``max`` for a
            ratio).
        source: ``engine`` (a per-pod value of the serving pods) or ``router`` (the engine's
            total, summed over the router's pods, labels ``namespace`` and ``engine``).
    """

    name: str
    series: str
    kind: str
    unit: str
    default_target: float
    pod_reduce: str = "sum"
    source: str = "engine"

    @property
    def per_engine(self) -> bool:
        """The value is the engine's total (the router's queue), not a per-pod average."""
        return self.source == "router"


SCALING_METRICS: tuple[ScalingMetric, ...] = (
    ScalingMetric("queueTime", METRIC_REQUEST_QUEUE_TIME, "histogram", "seconds", 0.5),
    ScalingMetric("timeToFirstToken", "kiln_time_to_first_token_seconds", "histogram", "seconds", 1.0),
    ScalingMetric("kvCacheUsage", "kiln_kv_cache_usage_ratio", "gauge", "ratio", 0.8, pod_reduce="max"),
    ScalingMetric("waitingRequests", "kiln_num_requests_waiting", "gauge", "requests", 4.0),
    ScalingMetric("routerQueue", ROUTER_QUEUE_SERIES, "gauge", "requests", 4.0, source="router"),
)
DEFAULT_METRIC = "queueTime"
_BY_NAME = {m.name: m for m in SCALING_METRICS}
assert all(m.series in METRIC_NAMES for m in SCALING_METRICS if m.source == "engine"), \
    "a scaling signal the runtime does not serve"


def scaling_metric(name: str) -> ScalingMetric:
    """The row of ``spec.autoscaling.metric`` ``name``.  Raises ``KeyError``."""
    return _BY_NAME[name]


def promql(metric: ScalingMetric, matchers: str, window: str = "2m") -> str:
    """A PromQL query of ``metric``'s mean per-pod value over the pods that ``matchers``
    select (``namespace="ns",model_name="m"``): for a histogram the mean observation over
    ``window``, for a gauge the average over pods of each pod's value; for the router's queue
    the engine's total over the router's pods (``matchers``: ``namespace="ns",engine="e"``)."""
    if metric.per_engine:
        return f"sum({metric.series}{{{matchers}}})"
    if metric.kind == "histogram":
        return (f"sum(rate({metric.series}_sum{{{matchers}}}[{window}])) / "
                f"clamp_min(sum(rate({metric.series}_count{{{matchers}}}[{window}])), 1e-9)")
    return f"avg({metric.pod_reduce}({metric.series}{{{matchers}}}) by (pod))"
