"""The operator's HTTP client of its serving pods' LoRA API: ``GET /v1/models`` (which
adapters a pod serves), ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, with
the pods' API key (``runtime.apiKeySecretRef``) as a bearer token when one is set.

Blocking (the reconcile runs in a worker thread); plain ``urllib``, no extra dependency.
An operator outside the cluster reaches only a local process-backed node's pods (as the
builtin autoscaler's fetcher: ``autoscaler._is_local_address``).
"""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request
from typing import Any

from .adapters import LoRAOp, LoRAResult
from .autoscaler import _is_local_address
from .constants import HTTP_PORT


class PodUnreachable(Exception):
    """A pod that did not answer (connection refused, timeout, not routable from here)."""


class PodLoRAClient:
    """Calls the LoRA endpoints of serving pods by pod IP.

    Args:
        timeout: seconds for ``/v1/models``; a load waits ``load_timeout`` (it reads the adapter).
        loopback_only: refuse pod IPs that are not on this machine (an operator outside the cluster).
        port: the pods' HTTP port.
    """

    def __init__(self, timeout: float = 5.0, load_timeout: float = 120.0, loopback_only: bool = False,
                 port: int = HTTP_PORT):
        self.timeout, self.load_timeout, self.loopback_only, self.port = timeout, load_timeout, loopback_only, port

    def _url(self, ip: str, path: str) -> str:
        if self.loopback_only and not (ipaddress.ip_address(ip).is_loopback or _is_local_address(ip)):
            raise PodUnreachable(f"pod IP {ip} is not reachable from outside the cluster")
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{self.port}{path}"

    def _call(self, ip: str, path: str, body: dict | None, api_key: str | None, timeout: float) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
        req = urllib.request.Request(self._url(ip, path), data=data, headers=headers,
                                     method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except ValueError:
                return e.code, {}
        except (OSError, ValueError) as e:  # refused, timed out, reset, not JSON
            raise PodUnreachable(f"{path}: {e}") from None

    def adapters(self, ip: str, api_key: str | None) -> dict[str, str]:
        """``{adapter name: folder}`` the pod at ``ip`` serves (the ``/v1/models`` entries with
        a ``parent``).  Raises PodUnreachable (also for a non-200 answer: a wrong API key)."""
        status, body = self._call(ip, "/v1/models", None, api_key, self.timeout)
        if status != 200:
            raise PodUnreachable(f"/v1/models answered {status}: {_message(body)}")
        return {m["id"]: str(m.get("root") or "") for m in body.get("data") or [] if m.get("parent")}

    def call(self, op: LoRAOp, api_key: str | None) -> LoRAResult:
        """Make one load or unload call; a pod that does not answer is status 0."""
        body: dict[str, str] = {"lora_name": op.name}
        if op.op == "load":
            body["lora_path"] = op.path
        try:
            status, reply = self._call(op.ip, f"/v1/{op.op}_lora_adapter", body, api_key, self.load_timeout)
        except PodUnreachable as e:
            return LoRAResult(op, 0, "PodUnreachable", str(e))
        err = reply.get("error") if isinstance(reply, dict) else None
        reason = str((err or {}).get("code") or "") if status != 200 else ""
        return LoRAResult(op, status, reason, _message(reply))


def _message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or "")
        return str(body.get("message") or "")
    return ""
