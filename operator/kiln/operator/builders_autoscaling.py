"""Pure builders of the replica owners of autoscaling modes ``hpa`` and ``keda``:
``(spec, owner) -> dict`` for server-side apply, like ``builders``.

Both scale the serving Deployment on the signal of ``spec.autoscaling.metric``
(``scaling_metrics``), per pod against ``autoscaling.target_value``:

- ``hpa``: an ``autoscaling/v2`` HorizontalPodAutoscaler with a ``Pods`` metric named after the
  runtime's series, as prometheus-adapter serves it with the chart's rule
  (helm/kiln/templates/prometheus-adapter-rule.yaml), target ``AverageValue``; for the router's
  queue (``routerQueue``) an ``External`` metric selected by ``engine`` (the chart's external
  rule), target ``AverageValue``: ``ceil(total / target)`` replicas;
- ``keda``: a ``keda.sh/v1alpha1`` ScaledObject with one ``prometheus`` trigger whose PromQL is
  the per-pod mean of the signal over the engine's pods (``namespace`` and ``model_name``
  labels: every Kiln metric carries ``model_name``) with ``metricType: Value``, so KEDA's HPA
  computes ``ceil(replicas * mean / target)`` as the HPA mode does; for the router's queue the
  engine's total (``namespace`` and ``engine`` labels) with ``metricType: AverageValue``.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import constants as c
from .builders import Obj, Spec, _meta, deployment_name, to_quantity
from .scaling_metrics import promql
from .spec import as_spec

__all__ = ["hpa", "scaled_object", "scaled_object_query", "KEDA_API_VERSION"]

KEDA_API_VERSION = "keda.sh/v1alpha1"


def _behavior(a) -> Obj:
    return {"scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_seconds},
            "scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_seconds}}


def hpa(spec: Spec, owner: Mapping[str, Any]) -> Obj:
    """The ``autoscaling/v2`` HPA for mode ``hpa``: a Pods metric named after the signal's
    series (``kiln_request_queue_time_seconds`` by default: mean queue time per pod, as
    prometheus-adapter's rule in the chart serves it), target ``AverageValue`` of
    ``autoscaling.target_value`` in the signal's unit (seconds, ratio or requests); for
    ``routerQueue`` an External metric of the engine's router queue, the same target per
    replica."""
    a = as_spec(spec).autoscaling
    target = {"type": "AverageValue", "averageValue": to_quantity(a.target_value)}
    if a.signal.per_engine:  # the router's queue: one series per engine, not per pod
        metric = {"type": "External", "external": {
            "metric": {"name": a.signal.series, "selector": {"matchLabels": {"engine": owner["name"]}}},
            "target": target}}
    else:
        metric = {"type": "Pods", "pods": {"metric": {"name": a.signal.series}, "target": target}}
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment_name(owner)},
            "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas,
            "metrics": [metric],
            "behavior": _behavior(a),
        },
    }


def scaled_object_query(spec: Spec, owner: Mapping[str, Any]) -> str:
    """The PromQL of the ScaledObject's trigger: the signal's mean per pod over the engine's
    pods (``namespace`` and ``model_name`` select them), or the router's queue of the engine
    (``namespace`` and ``engine``)."""
    s = as_spec(spec)
    a = s.autoscaling
    if a.signal.per_engine:
        return promql(a.signal, f'namespace="{owner["namespace"]}",engine="{owner["name"]}"', a.keda.query_window)
    model = s.model.served_model_name or owner["name"]
    return promql(a.signal, f'namespace="{owner["namespace"]}",model_name="{model}"', a.keda.query_window)


def scaled_object(spec: Spec, owner: Mapping[str, Any]) -> Obj:
    """The KEDA ScaledObject for mode ``keda``: the serving Deployment between
    ``minReplicas`` and ``maxReplicas`` on a ``prometheus`` trigger at ``keda.serverAddress``,
    threshold ``autoscaling.target_value``; the HPA that KEDA creates gets the same
    stabilization windows."""
    s = as_spec(spec)
    a = s.autoscaling
    return {
        "apiVersion": KEDA_API_VERSION, "kind": "ScaledObject",
        "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment_name(owner)},
            "minReplicaCount": a.min_replicas, "maxReplicaCount": a.max_replicas,
            "pollingInterval": a.keda.polling_interval_seconds, "cooldownPeriod": a.keda.cooldown_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(a)}},
            "triggers": [{"type": "prometheus", "name": a.metric.lower(),
                          "metricType": "AverageValue" if a.signal.per_engine else "Value",
                          "metadata": {"serverAddress": a.keda.server_address,
                                       "query": scaled_object_query(s, owner),
                                       "threshold": format(a.target_value, "g"),
                                       "ignoreNullValues": "true"}}],
        },
    }
