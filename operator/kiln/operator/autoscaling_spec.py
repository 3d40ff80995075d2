"""``spec.autoscaling`` as a typed section: who owns the Deployment's replicas, on which signal
(``scaling_metrics.SCALING_METRICS``) and with what target.

``parse_autoscaling(raw)`` reads the resource's ``spec`` (CRD defaults filled where the API
server did not) and raises ``EngineSpecError`` naming the field for what the schema cannot
check (a KEDA mode without a Prometheus address, a target out of the metric's range).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kiln.common.enginespec import EngineSpecError

from .scaling_metrics import DEFAULT_METRIC, SCALING_METRICS, ScalingMetric, scaling_metric

__all__ = ["AUTOSCALING_MODES", "KedaSpec", "AutoscalingSpec", "parse_autoscaling"]

AUTOSCALING_MODES = ("off", "hpa", "builtin", "keda")


@dataclass(frozen=True)
class KedaSpec:
    """``spec.autoscaling.keda``: the ScaledObject's Prometheus trigger and polling.

    Fields:
        server_address: the Prometheus base URL KEDA queries (``http://prometheus.monitoring:9090``).
        polling_interval_seconds: how often KEDA evaluates the trigger.
        cooldown_seconds: KEDA's ``cooldownPeriod`` (only acts at zero replicas).
        query_window: the PromQL rate window of a histogram signal (``2m``).
    """

    server_address: str = ""
    polling_interval_seconds: int = 15
    cooldown_seconds: int = 300
    query_window: str = "2m"


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``: who owns the Deployment's replicas and on what signal.

    Fields:
        mode: ``off`` (``spec.replicas``), ``hpa`` (an autoscaling/v2 HPA on a Pods metric served
            by prometheus-adapter), ``builtin`` (the operator scrapes the pods itself) or ``keda``
            (a KEDA ScaledObject with a Prometheus trigger).
        min_replicas / max_replicas: bounds when autoscaling (max defaults to max(4, min)).
        metric: the signal (``scaling_metrics``): queueTime (default), timeToFirstToken,
            kvCacheUsage, waitingRequests or routerQueue (the Kiln router's queue of the engine).
        target_queue_time_seconds: target mean request queue time per pod (metric queueTime).
        target: the per-pod target in the metric's unit; None: ``targetQueueTimeSeconds`` for
            queueTime, the metric's default otherwise.
        scale_up_stabilization_seconds / scale_down_stabilization_seconds: windows.
        keda: the ScaledObject's settings (mode ``keda``).
        scale_to_zero_after_seconds: idle window (no request through the router, none scheduled
            by a pod) after which an engine with ``min_replicas`` 0 goes to 0 replicas; None:
            never (then ``min_replicas`` is at least 1).
    """

    mode: str = "off"
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_time_seconds: float = 0.5
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    metric: str = DEFAULT_METRIC
    target: float | None = None
    keda: KedaSpec = field(default_factory=KedaSpec)
    scale_to_zero_after_seconds: int | None = None

    @property
    def scales_to_zero(self) -> bool:
        """The engine goes to 0 replicas when idle (``minReplicas: 0``, builtin mode)."""
        return self.min_replicas == 0 and self.scale_to_zero_after_seconds is not None

    @property
    def signal(self) -> ScalingMetric:
        """The row of ``metric`` in ``scaling_metrics``."""
        return scaling_metric(self.metric)

    @property
    def target_value(self) -> float:
        """The per-pod target in the signal's unit."""
        if self.target is not None:
            return self.target
        if self.metric == DEFAULT_METRIC:
            return self.target_queue_time_seconds
        return self.signal.default_target


def _num(a: Mapping[str, Any], key: str, default: Any, kind: type | tuple) -> Any:
    v = a.get(key)
    if v is None:
        return default
    if kind is int and isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, kind):
        raise EngineSpecError(f"autoscaling.{key}: expected {'an integer' if kind is int else 'a number'}, got {v!r}")
    return v


def _keda(a: Mapping[str, Any], mode: str) -> KedaSpec:
    k = a.get("keda") or {}
    if not isinstance(k, Mapping):
        raise EngineSpecError("autoscaling.keda: expected an object")
    addr = k.get("serverAddress") or ""
    if not isinstance(addr, str):
        raise EngineSpecError(f"autoscaling.keda.serverAddress: expected a string, got {addr!r}")
    if mode == "keda" and not addr:
        raise EngineSpecError("autoscaling.keda.serverAddress: mode keda needs the Prometheus URL that KEDA queries")
    if addr and not addr.startswith(("http://", "https://")):
        raise EngineSpecError(f"autoscaling.keda.serverAddress: {addr!r} is not a Prometheus URL (http://... or "
                              "https://..., e.g. http://prometheus.monitoring:9090)")
    return KedaSpec(server_address=addr,
                    polling_interval_seconds=_num(k, "pollingIntervalSeconds", 15, int),
                    cooldown_seconds=_num(k, "cooldownSeconds", 300, int),
                    query_window=str(k.get("queryWindow") or "2m"))


def parse_autoscaling(raw: Mapping[str, Any]) -> AutoscalingSpec:
    """``spec.autoscaling`` of a raw ``spec``.  Raises ``EngineSpecError`` naming the field."""
    a = raw.get("autoscaling")
    if a is None:
        a = {}
    if not isinstance(a, Mapping):
        raise EngineSpecError(f"autoscaling: expected an object, got {type(a).__name__}")
    mode = a.get("mode") or "off"
    if mode not in AUTOSCALING_MODES:
        raise EngineSpecError(f"autoscaling.mode: {mode!r} is not one of {', '.join(AUTOSCALING_MODES)}")
    metric = a.get("metric") or DEFAULT_METRIC
    names = [m.name for m in SCALING_METRICS]
    if metric not in names:
        raise EngineSpecError(f"autoscaling.metric: {metric!r} is not one of {', '.join(names)}")
    low = _num(a, "minReplicas", 1, int)
    # --- scale to zero (the router holds requests while an idle engine scales 0 -> 1) ---
    idle = _num(a, "scaleToZeroAfterSeconds", None, int)
    if idle is not None and idle < 1:
        raise EngineSpecError(f"autoscaling.scaleToZeroAfterSeconds: {idle} must be at least 1")
    if low == 0 and (idle is None or mode != "builtin"):
        raise EngineSpecError("autoscaling.minReplicas: 0 needs mode builtin and scaleToZeroAfterSeconds "
                              "(the idle window after which the engine goes to zero)")
    if low < 0:
        raise EngineSpecError(f"autoscaling.minReplicas: {low} must be at least 0")
    if idle is not None and low != 0:
        raise EngineSpecError(f"autoscaling.scaleToZeroAfterSeconds: only with minReplicas: 0 (it is {low}); "
                              "the engine never goes below minReplicas")
    # --- end scale to zero ---
    target = _num(a, "target", None, (int, float))
    if target is not None and (target <= 0 or (scaling_metric(metric).unit == "ratio" and target > 1)):
        raise EngineSpecError(f"autoscaling.target: {target} is out of range for {metric} "
                              f"({'a fraction in (0, 1]' if scaling_metric(metric).unit == 'ratio' else 'above 0'})")
    return AutoscalingSpec(
        mode=mode, min_replicas=low,
        max_replicas=_num(a, "maxReplicas", max(4, low), int),
        target_queue_time_seconds=float(_num(a, "targetQueueTimeSeconds", 0.5, (int, float))),
        scale_up_stabilization_seconds=_num(a, "scaleUpStabilizationSeconds", 0, int),
        scale_down_stabilization_seconds=_num(a, "scaleDownStabilizationSeconds", 300, int),
        metric=metric, target=None if target is None else float(target), keda=_keda(a, mode),
        scale_to_zero_after_seconds=idle)
