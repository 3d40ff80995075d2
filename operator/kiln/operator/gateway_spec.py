"""``spec.gateway``: exposure of an InferenceEngine through the Gateway API, as a typed section.

``httpRoute`` asks for a ``gateway.networking.k8s.io/v1`` HTTPRoute attached to the given
Gateways (``parentRefs``); ``inferencePool`` asks for a Gateway API Inference Extension
``InferencePool`` over the serving pods, with an endpoint picker (the extension's EPP) that
reads Kiln's metrics, deployed by the operator unless an existing one is named.
``parse_gateway(raw)`` raises ``EngineSpecError`` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kiln.common.enginespec import EngineSpecError

__all__ = ["EPP_IMAGE", "EPP_PORT", "HTTPRouteSpec", "EndpointPickerSpec", "InferencePoolSpec", "GatewaySpec",
           "parse_gateway"]

# The endpoint picker of sigs.k8s.io/gateway-api-inference-extension v1.2.0 (the version whose
# InferencePool CRD the tests install): its image, and its gRPC ext-proc port (--grpc-port).
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.2.0"
EPP_PORT = 9002
FAILURE_MODES = ("FailClose", "FailOpen")
_PARENT_KEYS = ("group", "kind", "namespace", "name", "sectionName", "port")
# Gateway API's ``Hostname`` (gateway.networking.k8s.io/v1): lowercase RFC 1123 labels, an
# optional leading ``*.`` wildcard, at most 253 characters; the API server refuses any other.
_HOSTNAME = re.compile(r"(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class HTTPRouteSpec:
    """``spec.gateway.httpRoute``.

    Fields:
        parent_refs: the Gateways (or listeners) the route attaches to, as HTTPRoute
            ``parentRefs`` entries (``{"name", "namespace"?, "sectionName"?, "port"?}``).
        hostnames: the route's ``hostnames`` (empty: every host of the listener).
        path_prefix: the ``PathPrefix`` the route matches (default ``/``).
    """

    parent_refs: tuple[Mapping[str, Any], ...]
    hostnames: tuple[str, ...] = ()
    path_prefix: str = "/"


@dataclass(frozen=True)
class EndpointPickerSpec:
    """``spec.gateway.inferencePool.endpointPicker``: the EPP the InferencePool refers to.

    Fields:
        deploy: the operator runs the EPP (Deployment, Service, ServiceAccount and a
            RoleBinding to the chart's ClusterRole, named ``<engine>-epp``) with Kiln's metric names; False refers to an
            existing EPP Service ``service_name``.
        service_name: the EPP's Service when ``deploy`` is False.
        image: the EPP image when ``deploy``.
        port: the EPP Service's gRPC port.
        failure_mode: what the gateway does when the EPP does not answer (FailClose, FailOpen).
    """

    deploy: bool = True
    service_name: str = ""
    image: str = EPP_IMAGE
    port: int = EPP_PORT
    failure_mode: str = "FailClose"


@dataclass(frozen=True)
class InferencePoolSpec:
    """``spec.gateway.inferencePool`` when enabled."""

    endpoint_picker: EndpointPickerSpec = field(default_factory=EndpointPickerSpec)


@dataclass(frozen=True)
class GatewaySpec:
    """``spec.gateway``: None fields are not asked for."""

    http_route: HTTPRouteSpec | None = None
    inference_pool: InferencePoolSpec | None = None

    @property
    def wanted(self) -> bool:
        """Anything of the Gateway API is asked for."""
        return self.http_route is not None or self.inference_pool is not None


def _obj(v: Any, path: str) -> Mapping[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise EngineSpecError(f"{path}: expected an object, got {type(v).__name__}")
    return v


def _route(raw: Mapping[str, Any]) -> HTTPRouteSpec | None:
    if raw.get("httpRoute") is None:
        return None
    r = _obj(raw["httpRoute"], "gateway.httpRoute")
    if r.get("enabled") is False:
        return None
    refs = r.get("parentRefs") or []
    if not isinstance(refs, list) or not refs:
        raise EngineSpecError("gateway.httpRoute.parentRefs: at least one Gateway to attach the route to is required")
    parents = []
    for i, ref in enumerate(refs):
        ref = _obj(ref, f"gateway.httpRoute.parentRefs[{i}]")
        if not isinstance(ref.get("name"), str) or not ref["name"]:
            raise EngineSpecError(f"gateway.httpRoute.parentRefs[{i}].name: required")
        parents.append({k: ref[k] for k in _PARENT_KEYS if ref.get(k) is not None})
    hosts = r.get("hostnames") or []
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
        raise EngineSpecError("gateway.httpRoute.hostnames: expected a list of host names")
    for i, h in enumerate(hosts):
        if len(h) > 253 or not _HOSTNAME.fullmatch(h):
            raise EngineSpecError(f"gateway.httpRoute.hostnames[{i}]: {h!r} is not a host name (lowercase "
                                  "letters, digits, '-' and '.', an optional leading '*.')")
    prefix = r.get("pathPrefix") or "/"
    if not isinstance(prefix, str) or not prefix.startswith("/"):
        raise EngineSpecError(f"gateway.httpRoute.pathPrefix: {prefix!r} must start with /")
    return HTTPRouteSpec(tuple(parents), tuple(hosts), prefix)


def _pool(raw: Mapping[str, Any]) -> InferencePoolSpec | None:
    p = _obj(raw.get("inferencePool"), "gateway.inferencePool")
    if not p.get("enabled"):
        return None
    e = _obj(p.get("endpointPicker"), "gateway.inferencePool.endpointPicker")
    deploy = e.get("deploy", True)
    name = e.get("serviceName") or ""
    if not isinstance(deploy, bool):
        raise EngineSpecError(f"gateway.inferencePool.endpointPicker.deploy: expected true or false, got {deploy!r}")
    if not deploy and not name:
        raise EngineSpecError("gateway.inferencePool.endpointPicker.serviceName: required when deploy is false "
                              "(the Service of an endpoint picker running elsewhere)")
    mode = e.get("failureMode") or "FailClose"
    if mode not in FAILURE_MODES:
        raise EngineSpecError(f"gateway.inferencePool.endpointPicker.failureMode: {mode!r} is not one of "
                              f"{', '.join(FAILURE_MODES)}")
    port = e.get("port", EPP_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise EngineSpecError(f"gateway.inferencePool.endpointPicker.port: {port!r} is not a port number")
    return InferencePoolSpec(EndpointPickerSpec(deploy=deploy, service_name=name if not deploy else "",
                                                image=e.get("image") or EPP_IMAGE, port=port, failure_mode=mode))


def parse_gateway(raw: Mapping[str, Any]) -> GatewaySpec:
    """``spec.gateway`` of a raw ``spec``.  Raises ``EngineSpecError`` naming the field."""
    g = _obj(raw.get("gateway"), "gateway")
    return GatewaySpec(http_route=_route(g), inference_pool=_pool(g))
