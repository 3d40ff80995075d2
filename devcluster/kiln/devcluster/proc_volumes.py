"""Projected volumes and the per-container mount namespace of the process-backed node's pods.

Test infrastructure (see procnode.py).  A real kubelet gives every pod whose ServiceAccount
automounts a token the volume that the ServiceAccount admission plugin adds
(``kube-api-access-*``, mounted at ``/var/run/secrets/kubernetes.io/serviceaccount``): a bound
token from the TokenRequest API, the namespace's ``kube-root-ca.crt`` ConfigMap as ``ca.crt``
and the namespace from the downward API.  This module writes those files the same way
(``write_projected``), refreshes tokens at 80% of their lifetime as the kubelet does
(``TokenRefresher``), and maps the well-known paths that in-cluster clients read without being
told (``NAMESPACE_MOUNT_ROOTS``) into a container's own mount namespace (``mountns_argv``):
its processes run on the host, so path rewriting of arguments cannot reach a path that the
kubernetes client library has compiled in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

# Mount paths a program finds without being told (so argument rewriting cannot map them):
# they are bind-mounted in the container's own mount namespace instead.
NAMESPACE_MOUNT_ROOTS = ("/var/run/secrets/", "/run/secrets/")

# Run as `python -I -S -c _MOUNT_EXEC N SRC1 DST1 RO1 ... ARGV...` inside `unshare --mount`:
# bind-mounts each SRC on DST (read-only when RO is "1"; DST is created, empty, if missing),
# then becomes ARGV.  The namespace is private, so the host and other pods never see the mounts.
_MOUNT_EXEC = (
    "import os, subprocess, sys\n"
    "n = int(sys.argv[1])\n"
    "for i in range(n):\n"
    "    src, dst, ro = sys.argv[2 + 3 * i: 5 + 3 * i]\n"
    "    os.makedirs(dst, exist_ok=True)\n"
    "    subprocess.run(['mount', '--bind', src, dst], check=True)\n"
    "    if ro == '1':\n"
    "        subprocess.run(['mount', '-o', 'remount,bind,ro', dst], check=True)\n"
    "argv = sys.argv[2 + 3 * n:]\n"
    "os.execv(argv[0], argv)\n"
)


def can_make_mount_namespaces() -> bool:
    """True when this process may create a private mount namespace and bind-mount in it
    (root or CAP_SYS_ADMIN, ``unshare`` and ``mount`` from util-linux installed)."""
    if not (shutil.which("unshare") and shutil.which("mount")):
        return False
    import tempfile
    with tempfile.TemporaryDirectory(prefix="kiln-mountns-") as d:
        try:
            r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "mount", "--bind", d, d],
                               capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return r.returncode == 0


def namespace_mounts(c: dict, volume_dirs: dict[str, str]) -> list[tuple[str, str, bool]]:
    """``(host folder, mountPath, read-only)`` for each of container ``c``'s volume mounts
    under ``NAMESPACE_MOUNT_ROOTS``, shortest mountPath first (parents before children)."""
    out = []
    for m in c.get("volumeMounts") or []:
        path = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(NAMESPACE_MOUNT_ROOTS):
            continue
        host = volume_dirs[m["name"]]
        if m.get("subPath"):
            host = str(Path(host) / m["subPath"])
        out.append((host, m["mountPath"], bool(m.get("readOnly"))))
    return sorted(out, key=lambda x: len(x[1]))


def mountns_argv(mounts: list[tuple[str, str, bool]], argv: list[str], python: str) -> list[str]:
    """``argv`` run in a private mount namespace with ``mounts`` (``namespace_mounts``)
    bind-mounted; ``argv`` itself when there is nothing to mount.  The process keeps its pid
    (``unshare`` without ``--fork`` execs), so its process group and death signal stay."""
    if not mounts:
        return argv
    flat = [x for host, dst, ro in mounts for x in (host, dst, "1" if ro else "0")]
    return [shutil.which("unshare") or "unshare", "--mount", "--propagation", "private", "--",
            python, "-I", "-S", "-c", _MOUNT_EXEC, str(len(mounts)), *flat, *argv]


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` in one step (readers never see half a token)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def request_token(api: Any, pod: dict, src: dict) -> tuple[str, float]:
    """A bound ServiceAccount token for ``pod``, as the kubelet asks for it: TokenRequest for the
    pod's ServiceAccount with the projection's audience and ``expirationSeconds`` (default
    3600), bound to the pod object (it stops working once the pod is gone).  Returns
    ``(token, seconds it is valid for)``.  Raises ``kubernetes.client.ApiException``."""
    meta, spec = pod["metadata"], pod["spec"]
    sat = src["serviceAccountToken"]
    body: dict[str, Any] = {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": int(sat.get("expirationSeconds", 3600)),
                 "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
    if sat.get("audience"):
        body["spec"]["audiences"] = [sat["audience"]]
    tr = api.create_namespaced_service_account_token(spec.get("serviceAccountName") or "default",
                                                     meta["namespace"], body)
    ttl = (tr.status.expiration_timestamp.timestamp() - time.time()) if tr.status.expiration_timestamp \
        else float(body["spec"]["expirationSeconds"])
    return tr.status.token, max(ttl, 1.0)


def write_projected(api: Any, pod: dict, src: dict, vdir: Path, field: Callable[[str], str]) -> float | None:
    """Writes one source of a projected volume into ``vdir``; returns when (``time.monotonic()``)
    its token is due for a refresh (80% of its lifetime, as the kubelet does), None for sources
    without a token.  ``field(path)`` resolves a downward-API fieldPath.  Raises
    ``kubernetes.client.ApiException`` (no such ServiceAccount or ConfigMap, no right to ask)
    and ``KeyError`` (a ConfigMap without a listed key)."""
    if "serviceAccountToken" in src:
        token, ttl = request_token(api, pod, src)
        _write_atomic(vdir / src["serviceAccountToken"].get("path", "token"), token.encode())
        return time.monotonic() + 0.8 * ttl
    if "configMap" in src:
        ref = src["configMap"]
        cm = api.read_namespaced_config_map(ref["name"], pod["metadata"]["namespace"])
        data = cm.data or {}
        for item in ref.get("items") or [{"key": k, "path": k} for k in data]:
            if item["key"] not in data:
                if ref.get("optional"):
                    continue
                raise KeyError(f"configmap {ref['name']} has no key {item['key']!r}")
            (vdir / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(vdir / item["path"], data[item["key"]].encode())
    elif "downwardAPI" in src:
        for item in src["downwardAPI"].get("items") or []:
            fp = (item.get("fieldRef") or {}).get("fieldPath", "")
            _write_atomic(vdir / item["path"], field(fp).encode())
    return None


class TokenRefresher:
    """The tokens of one pod's projected volumes and when each is due again."""

    def __init__(self) -> None:
        self._due: list[tuple[float, dict, Path]] = []
        self._lock = threading.Lock()

    def add(self, due: float, src: dict, vdir: Path) -> None:
        with self._lock:
            self._due.append((due, src, vdir))

    def refresh(self, api: Any, pod: dict, log: Callable[[str], None]) -> None:
        """Requests a fresh token for each one due; a failure is retried 10 s later."""
        now = time.monotonic()
        with self._lock:
            due, self._due = [d for d in self._due if d[0] <= now], [d for d in self._due if d[0] > now]
        for _, src, vdir in due:
            try:
                token, ttl = request_token(api, pod, src)
                _write_atomic(vdir / src["serviceAccountToken"].get("path", "token"), token.encode())
                self.add(time.monotonic() + 0.8 * ttl, src, vdir)
            except Exception as e:  # noqa: BLE001 - the old token stays until it expires
                log(f"token refresh failed: {e}")
                self.add(now + 10, src, vdir)
