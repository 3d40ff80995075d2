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
