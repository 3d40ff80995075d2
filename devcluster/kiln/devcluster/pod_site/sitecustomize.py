"""Imported at start-up by every Python process of a process-backed node's pod (procnode.py puts
this folder first on the pod's PYTHONPATH).  Test infrastructure, never part of an image.

All pods of the node share the host's network namespace.  A program that listens on the
wildcard address (``0.0.0.0`` or ``""``, e.g. the operator's health endpoint) would take the
port on every address, so a second pod, or another plane's pod, could not listen on it; in a
real pod the wildcard means the pod's own addresses.  With ``KILN_PROCNODE_POD_IP`` set (by the
node), an IPv4 ``bind`` to the wildcard binds the pod IP instead, the way the node already
rewrites ``0.0.0.0`` in a container's arguments and environment.
"""

import os
import socket

_POD_IP = os.environ.get("KILN_PROCNODE_POD_IP")

if _POD_IP:
    _bind = socket.socket.bind

    def _bind_pod_ip(self, address):
        if self.family == socket.AF_INET and isinstance(address, tuple) and address and address[0] in ("", "0.0.0.0"):
            address = (_POD_IP, *address[1:])
        return _bind(self, address)

    socket.socket.bind = _bind_pod_ip

# Service names (proc_services.py): with ``KILN_PROCNODE_HOSTS`` set, a name of the node's hosts
# file resolves to its Service address, looked up with the kubelet's search path for the pod's
# namespace (``ndots:5``: a name with fewer than five dots is tried with each suffix first).
_HOSTS = os.environ.get("KILN_PROCNODE_HOSTS")

if _HOSTS:
    _NAMESPACE = os.environ.get("KILN_PROCNODE_POD_NAMESPACE", "default")
    _SEARCH = (f"{_NAMESPACE}.svc.cluster.local", "svc.cluster.local", "cluster.local")
    _getaddrinfo = socket.getaddrinfo
    _gethostbyname = socket.gethostbyname

    def _service_ip(host):
        if not isinstance(host, str) or not host:
            return None
        try:
            with open(_HOSTS) as f:
                names = {n: line.split()[0] for line in f for n in line.split()[1:]}
        except OSError:
            return None
        name = host.rstrip(".").lower()
        tries = [name] if host.endswith(".") or name.count(".") >= 5 else [f"{name}.{s}" for s in _SEARCH] + [name]
        return next((names[t] for t in tries if t in names), None)

    def _getaddrinfo_services(host, *args, **kwargs):
        return _getaddrinfo(_service_ip(host) or host, *args, **kwargs)

    def _gethostbyname_services(host):
        return _service_ip(host) or _gethostbyname(host)

    socket.getaddrinfo = _getaddrinfo_services
    socket.gethostbyname = _gethostbyname_services
