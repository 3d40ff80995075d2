"""The builtin autoscaler: scrape each serving pod's ``/metrics``, read the signal of
``spec.autoscaling.metric`` (``scaling_metrics``: a histogram such as
``kiln_request_queue_time_seconds`` as its mean per observation over the last interval, a
gauge such as ``kiln_kv_cache_usage_ratio`` as its current value), average it over pods, and
recommend replicas the way the HPA does (``ceil(current * metric / target)``
with a 10% tolerance), through stabilization windows (scale up to the *lowest*
recommendation of the up-window, down to the *highest* of the down-window).

For ``routerQueue`` the scraped pods are the Kiln router's (the operator's
``--router-namespace``/``--router-selector``): ``kiln_router_queue_requests`` of the engine
(labels ``namespace`` and ``engine``) summed over them is the engine's queue, read per replica
(the total over the current replicas), so the rule gives ``ceil(total / target)``.

The parsing and the decision are pure; ``BuiltinAutoscaler`` holds the per-engine history in
memory (after an operator restart it starts again from the Deployment's current replicas).
"""

from __future__ import annotations

import math
import re
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from .constants import HTTP_PORT, METRIC_REQUEST_QUEUE_TIME, METRICS_PATH
from .scaling_metrics import ScalingMetric, scaling_metric
from .spec import AutoscalingSpec

#: The runtime's gauge of requests waiting to be scheduled: a histogram signal's interval with no
#: request scheduled reads as 0 only when none waits (long requests on few slots schedule rarely).
WAITING_SERIES = scaling_metric("waitingRequests").series

TOLERANCE = 0.1  # like the HPA: no change while |metric/target - 1| <= 10%

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)")

# fetch(pod) -> Prometheus text.  Raises on failure (the pod is then skipped).
MetricsFetcher = Callable[[Mapping[str, Any]], str]


def http_fetcher(timeout: float = 2.0, loopback_only: bool = False) -> MetricsFetcher:
    """The default fetcher: ``GET http://<podIP>:<port>/metrics``, the port of the pod's
    container port named ``http`` (8000 on a serving pod, 8080 on a router pod), 8000 without one.  ``loopback_only`` (an
    operator running outside the cluster, where pod IPs are not routable: only a local
    process-backed node's 127.x pods are scraped) refuses every other address."""
    import ipaddress

    def fetch(pod: Mapping[str, Any]) -> str:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            raise LookupError("pod has no IP")
        if loopback_only and not (ipaddress.ip_address(ip).is_loopback or _is_local_address(ip)):
            raise LookupError(f"pod IP {ip} is not reachable from outside the cluster")
        host = f"[{ip}]" if ":" in ip else ip
        with urllib.request.urlopen(f"http://{host}:{_http_port(pod)}{METRICS_PATH}", timeout=timeout) as r:
            return r.read().decode("utf-8", errors="replace")

    return fetch


def _http_port(pod: Mapping[str, Any]) -> int:
    """The container port named ``http`` of ``pod``, else the serving port."""
    for ctr in (pod.get("spec") or {}).get("containers") or ():
        for port in ctr.get("ports") or ():
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return HTTP_PORT


def _is_local_address(ip: str) -> bool:
    """True for an address of this machine (e.g. a process-backed test node's pod IP, added
    to ``lo``): binding to it succeeds only then."""
    import socket
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class HistogramTotals:
    """Cumulative ``_sum`` (seconds) and ``_count`` (requests) of one histogram, summed over
    label sets."""

    sum: float
    count: float


def parse_histogram(text: str, name: str = METRIC_REQUEST_QUEUE_TIME) -> HistogramTotals | None:
    """The totals of histogram ``name`` in Prometheus text exposition, or None when absent."""
    total_sum = total_count = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        metric, value = m.group(1), m.group(3)
        if metric == f"{name}_sum":
            total_sum += float(value)
            seen = True
        elif metric == f"{name}_count":
            total_count += float(value)
            seen = True
    return HistogramTotals(total_sum, total_count) if seen else None


_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_gauge(text: str, name: str, reduce: str = "sum", labels: Mapping[str, str] | None = None) -> float | None:
    """The value of gauge ``name`` in Prometheus text exposition (label sets combined by
    ``reduce``: ``sum`` or ``max``; only those carrying every label of ``labels``), or None when
    absent."""
    values = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m and m.group(1) == name:
            if labels and not labels.items() <= dict(_LABEL_RE.findall(m.group(2) or "")).items():
                continue
            values.append(float(m.group(3)))
    if not values:
        return None
    return max(values) if reduce == "max" else sum(values)


def mean_over_interval(prev: HistogramTotals | None, cur: HistogramTotals) -> float | None:
    """Mean queue time (seconds) of the requests scheduled between two scrapes; 0.0 when none
    were; None on the first scrape or after a counter reset."""
    if prev is None or cur.count < prev.count or cur.sum < prev.sum:
        return None
    dc = cur.count - prev.count
    return 0.0 if dc == 0 else (cur.sum - prev.sum) / dc


def recommend(current: int, metric: float, target: float, minimum: int, maximum: int) -> int:
    """HPA's rule: ``ceil(current * metric / target)`` clamped to ``[minimum, maximum]``,
    unchanged within the tolerance.  ``current`` 0 recommends ``minimum``."""
    if current <= 0:
        return minimum
    ratio = metric / target if target > 0 else math.inf
    if abs(ratio - 1.0) <= TOLERANCE:
        want = current
    else:
        want = math.ceil(current * ratio) if math.isfinite(ratio) else maximum
    return max(minimum, min(maximum, want))


def stabilize(history: Iterable[tuple[float, int]], current: int, now: float,
              up_window: float, down_window: float) -> int:
    """Apply stabilization windows to recommendations ``(time, replicas)`` (newest last):
    going up, take the lowest recommendation of the last ``up_window`` seconds (not below
    ``current``); going down, the highest of the last ``down_window`` seconds (not above
    ``current``)."""
    hist = list(history)
    if not hist:
        return current
    latest = hist[-1][1]
    if latest > current:
        recent = [r for t, r in hist if now - t <= up_window] or [latest]
        return max(current, min(recent))
    if latest < current:
        recent = [r for t, r in hist if now - t <= down_window] or [latest]
        return min(current, max(recent))
    return current


@dataclass
class EngineScaling:
    """Per-engine memory of the builtin autoscaler."""

    last_totals: dict[str, HistogramTotals] = field(default_factory=dict)  # pod name -> totals (histograms)
    history: deque = field(default_factory=lambda: deque(maxlen=512))  # (time, recommendation)
    desired: int | None = None
    observed: float | None = None
    metric: str = "queueTime"  # spec.autoscaling.metric of ``observed``
    last_scale_time: str | None = None
    last_active: str | None = None  # RFC 3339: last scrape that saw requests scheduled


class BuiltinAutoscaler:
    """Decides replicas for builtin-mode engines from their pods' metrics.

    ``fetcher`` reads one pod's metrics (default: HTTP to the pod IP); ``clock`` returns
    seconds (monotonic)."""

    def __init__(self, fetcher: MetricsFetcher | None = None, clock: Callable[[], float] = time.monotonic):
        self.fetcher = fetcher or http_fetcher(loopback_only=True)
        self.clock = clock
        self.engines: dict[str, EngineScaling] = {}

    def forget(self, key: str) -> None:
        """Drop the memory of an engine (deleted, or no longer in builtin mode)."""
        self.engines.pop(key, None)

    def wish(self, key: str) -> tuple[int | None, dict | None, str | None]:
        """``(desired replicas or None, status.autoscaler dict or None, last active time or
        None)`` for the reconciler; the last active time (RFC 3339) is the last scrape that saw
        a pod schedule requests (the scale-to-zero idle window's direct traffic)."""
        e = self.engines.get(key)
        if e is None:
            return None, None, None
        if e.desired is None:
            return None, None, e.last_active
        st: dict[str, Any] = {"desiredReplicas": e.desired}
        if e.observed is not None:
            if e.metric == "queueTime":
                st["observedQueueTimeSeconds"] = round(e.observed, 6)
            st["metric"], st["observedValue"] = e.metric, round(e.observed, 6)
        if e.last_scale_time:
            st["lastScaleTime"] = e.last_scale_time
        return e.desired, st, e.last_active

    def observe(self, key: str, pods: list[Mapping[str, Any]], current: int,
                scaling: AutoscalingSpec, now_iso: str) -> bool:
        """Scrape ``pods`` (the ready serving pods), update the recommendation of ``key``.
        Returns True when the desired replicas changed (the engine should be reconciled)."""
        e = self.engines.setdefault(key, EngineScaling())
        signal: ScalingMetric = scaling.signal
        if e.metric != scaling.metric:  # another signal: the histogram totals mean nothing now
            e.metric, e.last_totals, e.observed = scaling.metric, {}, None
        if signal.per_engine:
            return self._observe_router(e, key, pods, current, scaling, now_iso)
        means: list[float] = []
        alive = set()
        for pod in pods:
            name = pod["metadata"]["name"]
            alive.add(name)
            try:
                text = self.fetcher(pod)
            except Exception:  # noqa: BLE001 - an unreachable pod is skipped, like the HPA
                continue
            if signal.kind == "gauge":
                value = parse_gauge(text, signal.series, signal.pod_reduce)
                if value is not None:
                    means.append(value)
                continue
            totals = parse_histogram(text, signal.series)
            if totals is None:
                continue
            prev = e.last_totals.get(name)
            if prev is not None and totals.count > prev.count:
                e.last_active = now_iso
            mean = mean_over_interval(prev, totals)
            e.last_totals[name] = totals
            if mean == 0.0 and (parse_gauge(text, WAITING_SERIES) or 0.0) > 0:
                continue  # none scheduled in the interval while requests wait: no reading, not a queue time of 0
            if mean is not None:
                means.append(mean)
        for gone in set(e.last_totals) - alive:
            del e.last_totals[gone]
        if not means:
            return False
        return self._decide(e, sum(means) / len(means), current, scaling, now_iso)

    def _observe_router(self, e: EngineScaling, key: str, router_pods: list[Mapping[str, Any]], current: int,
                        scaling: AutoscalingSpec, now_iso: str) -> bool:
        """``observe`` for the router's queue: ``router_pods`` are the router's ready pods; the
        engine's queue is the sum of their ``kiln_router_queue_requests{namespace, engine}``."""
        namespace, _, name = key.partition("/")
        total, seen = 0.0, False
        for pod in router_pods:
            try:
                text = self.fetcher(pod)
            except Exception:  # noqa: BLE001 - an unreachable router pod is skipped
                continue
            value = parse_gauge(text, scaling.signal.series, labels={"namespace": namespace, "engine": name})
            seen = True  # a router that has not seen the engine yet has no series: a queue of 0
            total += value or 0.0
        if not seen:
            return False
        if total > 0:
            e.last_active = now_iso
        return self._decide(e, total / max(current, 1), current, scaling, now_iso)

    def _decide(self, e: EngineScaling, metric: float, current: int, scaling: AutoscalingSpec, now_iso: str) -> bool:
        """Record ``metric`` (per replica), recommend and stabilize; True when the desired
        replicas differ from ``current`` or changed."""
        e.observed = metric
        t = self.clock()
        rec = recommend(current, metric, scaling.target_value,
                        scaling.min_replicas, scaling.max_replicas)
        e.history.append((t, rec))
        up, down = scaling.scale_up_stabilization_seconds, scaling.scale_down_stabilization_seconds
        while e.history and t - e.history[0][0] > max(up, down) + 1:
            e.history.popleft()
        desired = stabilize(e.history, current, t, up, down)
        changed = desired != current and desired != e.desired
        if desired != current:
            e.last_scale_time = now_iso if changed else e.last_scale_time
        e.desired = desired
        return changed or desired != current
