"""The signals an InferenceEngine can autoscale on (``spec.autoscaling.metric``), as data.

Each row names the runtime's served metric (``kiln.common.metrics.METRICS``, what ``kiln
serve`` exposes on ``/metrics``), how one pod's value is read from it, and the target used when
``autoscaling.target`` is not set.  The same table drives the three consumers, so they cannot
disagree on a name:

- the HPA (mode ``hpa``): a Pods metric named ``series``, served by prometheus-adapter through
  the chart's rule (helm/kiln/templates/prometheus-adapter-rule.yaml), target ``AverageValue``;
- the KEDA ScaledObject (mode ``keda``): a ``prometheus`` trigger whose query is ``promql``;
- the builtin autoscaler (mode ``builtin``): the pods' ``/metrics`` scraped by the operator.

Histograms are read as the mean of the observations between two reads (``_sum`` rate over
``_count`` rate); gauges as their current value.  Every one is a per-pod average that grows
with load, which is what the HPA's ``ceil(replicas * value / target)`` needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.common.metrics import METRIC_NAMES, METRIC_REQUEST_QUEUE_TIME

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
    """

    name: str
    series: str
    kind: str
    unit: str
    default_target: float
    pod_reduce: str = "sum"


SCALING_METRICS: tuple[ScalingMetric, ...] = (
    ScalingMetric("queueTime", METRIC_REQUEST_QUEUE_TIME, "histogram", "seconds", 0.5),
    ScalingMetric("timeToFirstToken", "kiln_time_to_first_token_seconds", "histogram", "seconds", 1.0),
    ScalingMetric("kvCacheUsage", "kiln_kv_cache_usage_ratio", "gauge", "ratio", 0.8, pod_reduce="max"),
    ScalingMetric("waitingRequests", "kiln_num_requests_waiting", "gauge", "requests", 4.0),
)
DEFAULT_METRIC = "queueTime"
_BY_NAME = {m.name: m for m in SCALING_METRICS}
assert all(m.series in METRIC_NAMES for m in SCALING_METRICS), "a scaling signal the runtime does not serve"


def scaling_metric(name: str) -> ScalingMetric:
    """The row of ``spec.autoscaling.metric`` ``name``.  Raises ``KeyError``."""
    return _BY_NAME[name]


def promql(metric: ScalingMetric, matchers: str, window: str = "2m") -> str:
    """A PromQL query of ``metric``'s mean per-pod value over the pods that ``matchers``
    select (``namespace="ns",model_name="m"``): for a histogram the mean observation over
    ``window``, for a gauge the average over pods of each pod's value."""
    if metric.kind == "histogram":
        return (f"sum(rate({metric.series}_sum{{{matchers}}}[{window}])) / "
                f"clamp_min(sum(rate({metric.series}_count{{{matchers}}}[{window}])), 1e-9)")
    return f"avg({metric.pod_reduce}({metric.series}{{{matchers}}}) by (pod))"
