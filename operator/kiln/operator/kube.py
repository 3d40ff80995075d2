"""The operator's Kubernetes client: raw JSON over the ``kubernetes`` package's connection
handling, and the one server-side-apply helper (``Kube.apply``) with one field manager.

Plain dicts in and out (no generated models: less memory, no conversion).  Thread-safe: the
reconcile workers share one ``Kube``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from . import constants as c

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# (apiVersion, kind) -> (plural, namespaced).  Every kind the operator touches.
KINDS: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "PersistentVolumeClaim"): ("persistentvolumeclaims", True),
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Secret"): ("secrets", True),  # read only: the pods' API key (LoRA adapter calls)
    ("v1", "Service"): ("services", True),
    ("v1", "Event"): ("events", True),
    ("v1", "Pod"): ("pods", True),
    ("batch/v1", "Job"): ("jobs", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("horizontalpodautoscalers", True),
    ("coordination.k8s.io/v1", "Lease"): ("leases", True),
    (c.API_VERSION, c.KIND): (c.PLURAL, True),
    # spec.gateway (builders_gateway) and autoscaling mode keda (builders_autoscaling): optional
    # APIs, used only where discovery (Kube.served_kinds) finds them
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): ("httproutes", True),
    ("inference.networking.k8s.io/v1", "InferencePool"): ("inferencepools", True),
    ("keda.sh/v1alpha1", "ScaledObject"): ("scaledobjects", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
}


class ApiError(Exception):
    """A non-2xx answer from the API server.  ``status`` is the HTTP code, ``reason`` the
    Status reason (``NotFound``, ``Conflict``, ``Forbidden``...), ``body`` the parsed Status."""

    def __init__(self, status: int, reason: str, message: str, body: Any = None):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message, self.body = status, reason, message, body


def path_for(api_version: str, kind: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
    """The REST path of a kind (from ``KINDS``), optionally one object and a subresource.
    Raises ``KeyError`` for a kind the operator does not know."""
    plural, namespaced = KINDS[(api_version, kind)]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    p = f"{base}/namespaces/{namespace}/{plural}" if namespaced and namespace else f"{base}/{plural}"
    if name:
        p += f"/{name}"
        if subresource:
            p += f"/{subresource}"
    return p


@dataclass
class KubeConfig:
    """How to reach the API server.  ``kubeconfig=None`` tries in-cluster config, then
    ``$KUBECONFIG``/``~/.kube/config``.  ``impersonate`` sets ``Impersonate-User`` on every
    request (tests run the operator as the chart's ServiceAccount)."""

    kubeconfig: str | None = None
    context: str | None = None
    impersonate: str | None = None
    pool_size: int = 16


def load_configuration(cfg: KubeConfig):
    """A ``kubernetes.client.Configuration`` for ``cfg``.  Raises
    ``kubernetes.config.ConfigException`` when nothing is configured."""
    from kubernetes import client, config

    conf = client.Configuration()
    if cfg.kubeconfig:
        config.load_kube_config(config_file=cfg.kubeconfig, context=cfg.context,
                                client_configuration=conf)
    else:
        try:
            config.load_incluster_config(client_configuration=conf)
        except config.ConfigException:
            config.load_kube_config(context=cfg.context, client_configuration=conf)
    conf.connection_pool_maxsize = cfg.pool_size
    return conf


class Kube:
    """Raw JSON access to the API server.  All writes the operator makes go through
    ``apply`` (server-side apply, field manager ``kiln-operator``, force) except the
    ``delete`` of children it no longer wants, the owners of shared build Jobs
    (``set_owners``) and the Lease's compare-and-swap."""

    def __init__(self, cfg: KubeConfig | None = None, configuration: Any = None):
        from kubernetes import client

        self.cfg = cfg or KubeConfig()
        self.configuration = configuration or load_configuration(self.cfg)
        self.api = client.ApiClient(self.configuration)
        if self.cfg.impersonate:
            self.api.set_default_header("Impersonate-User", self.cfg.impersonate)

    def close(self) -> None:
        """Close the connection pool."""
        self.api.close()

    def request(self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None,
                content_type: str = "application/json", timeout: float = 30.0, text: bool = False) -> Any:
        """One HTTP request; returns the parsed JSON body (None when empty), or with ``text``
        the body as text.  Raises ``ApiError`` on a non-2xx answer."""
        # pods/log answers text/plain but, as of Kubernetes 1.36, refuses (406) an Accept that names
        # only text/plain: accept anything, as kubectl does
        headers = {"Accept": "application/json, */*" if text else "application/json", "Content-Type": content_type}
        data = body if (body is None or isinstance(body, (str, bytes))) else json.dumps(body)
        method_, url, hdrs, _, _ = self.api.param_serialize(
            method, path, query_params=list((query or {}).items()) or None,
            header_params=headers, auth_settings=["BearerToken"])
        resp = self.api.rest_client.pool_manager.request(
            method_, url, body=data.encode() if isinstance(data, str) else data, headers=hdrs,
            timeout=timeout, preload_content=True, retries=False)
        status = resp.status
        raw = resp.data
        if not 200 <= status < 300:
            try:
                st = json.loads(raw or b"{}")
            except ValueError:
                st = {}
            raise ApiError(status, st.get("reason") or str(resp.reason),
                           st.get("message") or raw.decode(errors="replace")[:500], st)
        if text:
            return (raw or b"").decode(errors="replace")
        return json.loads(raw) if raw else None

    # --- reads -------------------------------------------------------------------------------
    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Obj | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path_for(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None,
             label_selector: str | None = None) -> list[Obj]:
        """Items of a kind in a namespace (all namespaces when None)."""
        q = {"labelSelector": label_selector} if label_selector else None
        return self.request("GET", path_for(api_version, kind, namespace), query=q).get("items", [])

    def log(self, namespace: str, pod: str, container: str, tail_lines: int = 20,
            limit_bytes: int = 16384) -> str:
        """The last ``tail_lines`` lines (at most ``limit_bytes``) of a container's log, as
        ``kubectl logs --tail`` reads them (``pods/log``).  Raises ``ApiError`` (400 while the
        container has not started, 404 for a pod that is gone)."""
        return self.request("GET", path_for("v1", "Pod", namespace, pod, "log"), text=True, timeout=10.0,
                            query={"container": container, "tailLines": str(tail_lines),
                                   "limitBytes": str(limit_bytes)})

    def served_kinds(self, api_version: str) -> frozenset[str]:
        """The kinds the API server serves in group version ``api_version`` (discovery:
        ``GET /apis/<group>/<version>``); empty when the group version is not served (its CRDs
        are not installed).  Raises ``ApiError`` on other failures."""
        try:
            doc = self.request("GET", f"/apis/{api_version}", timeout=10.0) or {}
        except ApiError as e:
            if e.status in (404, 503):  # not installed, or an aggregated API that is down
                return frozenset()
            raise
        return frozenset(r["kind"] for r in doc.get("resources") or [] if "/" not in r.get("name", "/"))

    # --- writes ------------------------------------------------------------------------------
    def apply(self, obj: Mapping[str, Any], subresource: str | None = None,
              field_manager: str = c.FIELD_MANAGER, force: bool = True) -> Obj:
        """Server-side apply ``obj`` (its full desired state) as ``field_manager``.  Fields this
        manager set before and left out now are removed; fields of other managers stay.
        ``subresource="status"`` applies the status.  Returns the object after the apply.
        Raises ``ApiError``."""
        meta = obj["metadata"]
        path = path_for(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource)
        q = {"fieldManager": field_manager}
        if force:
            q["force"] = "true"
        return self.request("PATCH", path, body=obj, query=q, content_type="application/apply-patch+yaml")

    def set_owners(self, api_version: str, kind: str, namespace: str | None, name: str,
                   owner_references: list[Obj]) -> Obj:
        """Replace an object's ``metadata.ownerReferences`` (a JSON merge patch of that one
        field: the owners of a shared build Job change while its immutable pod template must
        not be re-applied).  Raises ``ApiError``."""
        return self.request("PATCH", path_for(api_version, kind, namespace, name),
                            body={"metadata": {"ownerReferences": owner_references}},
                            content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
               propagation: str = "Background") -> bool:
        """Delete an object; False when it was already gone.  Raises ``ApiError``."""
        try:
            self.request("DELETE", path_for(api_version, kind, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1",
                               "propagationPolicy": propagation})
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    def create(self, obj: Mapping[str, Any]) -> Obj:
        """POST a new object (the Lease's create-if-absent).  Raises ``ApiError`` (409 when it exists)."""
        meta = obj["metadata"]
        return self.request("POST", path_for(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj)

    def replace(self, obj: Mapping[str, Any]) -> Obj:
        """PUT an object with its ``resourceVersion`` (compare-and-swap).  Raises ``ApiError``."""
        meta = obj["metadata"]
        return self.request("PUT", path_for(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]), body=obj)


def connection_info(configuration: Any, impersonate: str | None = None):
    """A ``kopf.ConnectionInfo`` with the same credentials as ``configuration``, so kopf's
    watches and the reconcile client act as one identity.  Impersonation is not supported by
    kopf: pass a ServiceAccount token kubeconfig instead."""
    import kopf

    if impersonate:
        raise ValueError("kopf cannot impersonate; use a kubeconfig with the ServiceAccount's token")
    token = scheme = None
    auth = configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
    if auth:
        first, _, rest = auth.partition(" ")
        scheme, token = ("Bearer", first) if not rest else (first, rest)
    return kopf.ConnectionInfo(
        server=configuration.host, ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl, scheme=scheme, token=token,
        certificate_path=configuration.cert_file, private_key_path=configuration.key_file,
        username=configuration.username or None, password=configuration.password or None,
    )
