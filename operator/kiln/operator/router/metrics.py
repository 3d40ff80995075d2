"""The router's Prometheus metrics (``GET /metrics`` of the router).

``kiln_router_queue_requests{namespace, engine, model}`` is the scaling signal: requests held
(waiting for a ready replica, e.g. while the engine scales from zero) plus requests in flight
to a replica, per model.  ``spec.autoscaling.metric: routerQueue`` scales an engine on it
(``kiln.operator.scaling_metrics``: an External HPA metric through the chart's
prometheus-adapter rule, KEDA's Prometheus trigger, or the builtin autoscaler scraping the
router's pods); a value above 0 for an engine at zero replicas is exactly the demand that the
activity signal turns into a 0 -> 1.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..scaling_metrics import ROUTER_QUEUE_SERIES

LABELS = ("namespace", "engine", "model")


class RouterMetrics:
    """The router's metrics in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.held = Gauge("kiln_router_requests_held", "Requests waiting for a ready replica.", LABELS, registry=r)
        self.outstanding = Gauge("kiln_router_requests_outstanding", "Requests in flight to a replica.",
                                 LABELS, registry=r)
        self.queue = Gauge(ROUTER_QUEUE_SERIES,
                           "Held plus in-flight requests per model: the router's scaling signal.", LABELS, registry=r)
        self.requests = Counter("kiln_router_requests", "Requests answered, by HTTP status code.",
                                (*LABELS, "code"), registry=r)
        self.hold_seconds = Histogram("kiln_router_hold_seconds", "Time a request waited for a ready replica.",
                                      LABELS, registry=r,
                                      buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600))
        self.retries = Counter("kiln_router_upstream_retries", "Connections refused by a replica and retried "
                               "on another.", LABELS, registry=r)
        self.replicas = Gauge("kiln_router_ready_replicas", "Ready replicas the router routes to.",
                              ("namespace", "engine"), registry=r)
