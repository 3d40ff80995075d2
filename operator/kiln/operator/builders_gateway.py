"""Pure builders of an InferenceEngine's exposure through the Gateway API (``spec.gateway``):
``(spec, owner) -> dict`` for server-side apply, like ``builders``.

- ``http_route``: a ``gateway.networking.k8s.io/v1`` HTTPRoute attached to ``parentRefs``,
  sending ``pathPrefix`` to the engine's Service on port 8000, or to its InferencePool when
  one is served (the Gateway then asks the pool's endpoint picker which pod takes a request).
- ``inference_pool``: an ``inference.networking.k8s.io/v1`` InferencePool (Gateway API
  Inference Extension v1.x) selecting the serving pods on port 8000, its ``endpointPickerRef``
  naming the EPP Service.
- ``endpoint_picker``: the EPP the operator runs for the pool (ServiceAccount, a RoleBinding
  to the chart's role that reads pods and pools, Deployment, gRPC Service), owned by the
  InferencePool: deleting the pool garbage-collects its picker, so the operator needs no right
  to delete Deployments or Services, its flags mapping the
  extension's vLLM metric names to Kiln's (``EPP_METRIC_FLAGS``).
"""

from __future__ import annotations

from typing import Any, Mapping

from . import constants as c
from .builders import Obj, Spec, _container_security, _meta, _pod_security, child_name, deployment_name, \
    selector_labels
from .spec import as_spec

__all__ = ["GATEWAY_API_VERSION", "POOL_API_VERSION", "POOL_GROUP", "EPP_METRIC_FLAGS", "EPP_ROLE", "http_route",
           "inference_pool", "epp_name", "epp_args", "endpoint_picker"]

GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"
POOL_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_GROUP}/v1"
# The chart's role of the EPPs (read pods, InferencePools, InferenceObjectives): a ClusterRole in a
# cluster-scoped install, a Role per watched namespace otherwise (kiln operator
# --endpoint-picker-role KIND/NAME); bound per namespace by a RoleBinding, so the operator needs no
# Role-writing rights (only `bind` on that role).
EPP_ROLE = ("ClusterRole", "kiln-endpoint-picker")
COMPONENT_EPP = "endpoint-picker"
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090

# The EPP's metric flags (gateway-api-inference-extension cmd/epp/runner/runner.go), defaults
# in vLLM's names, set to the series ``kiln serve`` exposes (kiln.common.metrics):
#   vllm:num_requests_waiting   -> kiln_num_requests_waiting  (sequences waiting to be scheduled)
#   vllm:gpu_cache_usage_perc   -> kiln_kv_cache_usage_ratio  (fraction of KV blocks in use, 0-1)
#   vllm:lora_requests_info     -> "" (off: Kiln has no metric in that label format)
EPP_METRIC_FLAGS = (("--total-queued-requests-metric", "kiln_num_requests_waiting"),
                    ("--kv-cache-usage-percentage-metric", "kiln_kv_cache_usage_ratio"),
                    ("--lora-info-metric", ""))


def _backend(owner: Mapping[str, Any], pool: bool) -> Obj:
    if pool:
        return {"group": POOL_GROUP, "kind": "InferencePool", "name": deployment_name(owner)}
    return {"kind": "Service", "name": deployment_name(owner), "port": c.HTTP_PORT}


def http_route(spec: Spec, owner: Mapping[str, Any], *, to_pool: bool) -> Obj:
    """The HTTPRoute of ``spec.gateway.httpRoute``: ``PathPrefix`` ``pathPrefix`` of
    ``hostnames`` (all when empty) to the InferencePool when ``to_pool`` (one is applied),
    else to the Service.  Raises ``ValueError`` when no route is asked for."""
    route = as_spec(spec).gateway.http_route
    if route is None:
        raise ValueError("spec.gateway.httpRoute is not set")
    rspec: Obj = {"parentRefs": [dict(p) for p in route.parent_refs],
                  "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": route.path_prefix}}],
                             "backendRefs": [_backend(owner, to_pool)]}]}
    if route.hostnames:
        rspec["hostnames"] = list(route.hostnames)
    return {"apiVersion": GATEWAY_API_VERSION, "kind": "HTTPRoute",
            "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER), "spec": rspec}


def epp_name(owner: Mapping[str, Any]) -> str:
    """Name of the endpoint picker's Deployment, Service, ServiceAccount, Role and RoleBinding."""
    return child_name(deployment_name(owner), "epp")


def inference_pool(spec: Spec, owner: Mapping[str, Any]) -> Obj:
    """The InferencePool of ``spec.gateway.inferencePool``: the serving pods (their immutable
    selector labels) on port 8000, picked by the EPP Service (the operator's ``<name>-epp``
    or ``endpointPicker.serviceName``).  Raises ``ValueError`` when no pool is asked for."""
    pool = as_spec(spec).gateway.inference_pool
    if pool is None:
        raise ValueError("spec.gateway.inferencePool is not enabled")
    epp = pool.endpoint_picker
    return {"apiVersion": POOL_API_VERSION, "kind": "InferencePool",
            "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER),
            "spec": {"selector": {"matchLabels": selector_labels(owner)},
                     "targetPorts": [{"number": c.HTTP_PORT}],
                     "endpointPickerRef": {"kind": "Service", "name": epp.service_name or epp_name(owner),
                                           "port": {"number": epp.port}, "failureMode": epp.failure_mode}}}


def epp_args(spec: Spec, owner: Mapping[str, Any]) -> list[str]:
    """The EPP's flags: its pool, ports, Kiln's metric names, and no auth on its own
    ``/metrics`` nor tracing (neither has a receiver here)."""
    epp = as_spec(spec).gateway.inference_pool.endpoint_picker
    args = ["--pool-name", deployment_name(owner), "--pool-namespace", owner["namespace"],
            "--pool-group", POOL_GROUP, "--grpc-port", str(epp.port),
            "--grpc-health-port", str(EPP_HEALTH_PORT), "--metrics-port", str(EPP_METRICS_PORT),
            "--model-server-metrics-port", str(c.HTTP_PORT), "--model-server-metrics-path", c.METRICS_PATH,
            "--metrics-endpoint-auth=false", "--tracing=false"]
    for flag, value in EPP_METRIC_FLAGS:
        args += [flag, value]
    return args


def endpoint_picker(spec: Spec, owner: Mapping[str, Any], pool_uid: str,
                    role: tuple[str, str] = EPP_ROLE) -> list[Obj]:
    """The EPP the operator runs for the pool, in apply order: ServiceAccount, RoleBinding to
    ``role`` (``(kind, name)``: reads pods, InferencePools and InferenceObjectives of the
    namespace), Deployment (one replica, gRPC health probes), Service (the ext-proc port); each
    owned by the InferencePool of uid ``pool_uid``.  Empty when the spec names an EPP of its own
    or asks for no pool."""
    s = as_spec(spec)
    pool = s.gateway.inference_pool
    if pool is None or not pool.endpoint_picker.deploy:
        return []
    epp, name = pool.endpoint_picker, epp_name(owner)
    pool_ref = {"apiVersion": POOL_API_VERSION, "kind": "InferencePool", "name": deployment_name(owner),
                "uid": pool_uid, "controller": True, "blockOwnerDeletion": True}

    def meta() -> Obj:
        m = _meta(owner, name, COMPONENT_EPP, owned=False)
        m["ownerReferences"] = [dict(pool_ref)]
        return m

    sel = {c.LABEL_ENGINE: selector_labels(owner)[c.LABEL_ENGINE], c.LABEL_COMPONENT: COMPONENT_EPP}
    probe = {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 5}
    container = {
        "name": "epp", "image": epp.image, "imagePullPolicy": "IfNotPresent", "args": epp_args(s, owner),
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "grpc", "containerPort": epp.port}, {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT}],
        "livenessProbe": {**probe, "initialDelaySeconds": 5}, "readinessProbe": probe,
        "securityContext": _container_security()}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role[0], "name": role[1]},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner["namespace"]}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(),
         "spec": {"replicas": 1, "selector": {"matchLabels": sel},
                  "template": {"metadata": {"labels": {**meta()["labels"], **sel}},
                               "spec": {"serviceAccountName": name, "securityContext": _pod_security(),
                                        "containers": [container]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(),
         "spec": {"type": "ClusterIP", "selector": sel,
                  "ports": [{"name": "grpc", "port": epp.port, "targetPort": "grpc", "protocol": "TCP",
                             "appProtocol": "http2"}]}},
    ]
