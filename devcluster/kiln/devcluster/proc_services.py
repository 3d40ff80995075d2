"""Services for the pods of the process-backed node: what kube-proxy and the cluster DNS give a
real pod, so that ``http://<service>.<namespace>.svc:<port>`` and
``https://kubernetes.default.svc`` work from inside one.

Test infrastructure (see procnode.py).  The plane has no kube-proxy and no DNS, and the
Services' ClusterIPs are the same on every plane (several run side by side on this machine),
so they cannot be put on ``lo``.  Instead each Service of the plane gets an address of the
node's own (``ProcNode.take_ip``: unique on this machine) and, for each of its ports, a
``ServiceProxy`` listening there on the Service's port and forwarding to its ready endpoints
(read for each new connection: a Service whose pods changed is seen by the next connection).
``default/kubernetes`` has no EndpointSlices here (the API server runs with
``--endpoint-reconciler-type=none``): it forwards to the API server itself.

The names go into a hosts file (``<ip> <service>.<namespace>.svc.cluster.local``), which
``pod_site/sitecustomize.py`` reads for the pods' Python processes with the kubelet's search
path (``<pod namespace>.svc.cluster.local svc.cluster.local cluster.local``, ``ndots:5``), so
``<service>``, ``<service>.<namespace>`` and ``<service>.<namespace>.svc`` resolve as in a pod.
ExternalName and headless Services get no address.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kiln.devcluster.proc_proxy import ServiceProxy

log = logging.getLogger("procnode")

CLUSTER_DOMAIN = "cluster.local"


@dataclass
class _Entry:
    """One Service's address and its proxies (one per port)."""

    uid: str
    ports: tuple  # ((name, port), ...): a change recreates the proxies
    ip: str
    proxies: list[ServiceProxy] = field(default_factory=list)


class ServiceNetwork:
    """The node's Service addresses, proxies and hosts file; ``sync()`` follows the plane's
    Services (``ProcNode`` calls it every second), ``stop()`` removes them all.

    Args:
        api: a ``CoreV1Api`` of the plane.
        hosts_file: where the names are written (replaced in one step on each change).
        take_ip / release_ip: the node's address allocator (``ProcNode.take_ip``/``release_ip``).
        apiserver_port: the API server's port on 127.0.0.1 (``default/kubernetes`` forwards there).
    """

    def __init__(self, api, hosts_file: Path, take_ip: Callable[[], str], release_ip: Callable[[str], None],
                 apiserver_port: int):
        self.api, self.hosts_file = api, Path(hosts_file)
        self.take_ip, self.release_ip = take_ip, release_ip
        self.apiserver_port = apiserver_port
        self.entries: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()
        self._write_hosts()

    def _proxies(self, ns: str, name: str, ip: str, ports: tuple) -> list[ServiceProxy]:
        fixed = [("127.0.0.1", self.apiserver_port)] if (ns, name) == ("default", "kubernetes") else None
        out = []
        try:
            for port_name, port in ports:
                out.append(ServiceProxy(self.api, ns, name, port_name=port_name, listen_host=ip, listen_port=port,
                                        poll_seconds=0, endpoints=fixed).start())
        except OSError:
            for p in out:
                p.stop()
            raise
        return out

    def sync(self) -> None:
        """Give each ClusterIP Service an address and proxies, drop those of Services gone (or
        changed), and rewrite the hosts file when anything changed.  Raises ``ApiException``."""
        items = self.api.list_service_for_all_namespaces().items
        want: dict[tuple[str, str], tuple[str, tuple]] = {}
        for svc in items:
            spec = svc.spec
            if spec.type == "ExternalName" or not spec.cluster_ip or spec.cluster_ip == "None":
                continue
            ports = tuple((p.name, int(p.port)) for p in spec.ports or [] if (p.protocol or "TCP") == "TCP")
            if ports:
                want[(svc.metadata.namespace, svc.metadata.name)] = (svc.metadata.uid, ports)
        with self._lock:
            changed = False
            for key, e in list(self.entries.items()):
                if want.get(key) != (e.uid, e.ports):
                    self._drop(key)
                    changed = True
            for key, (uid, ports) in want.items():
                if key in self.entries:
                    continue
                ip = self.take_ip()
                try:
                    proxies = self._proxies(*key, ip, ports)
                except OSError as err:
                    self.release_ip(ip)
                    log.warning("service %s/%s: cannot listen on %s: %s", *key, ip, err)
                    continue
                self.entries[key] = _Entry(uid, ports, ip, proxies)
                changed = True
                log.info("service %s/%s: %s ports %s", *key, ip, ",".join(str(p) for _, p in ports))
            if changed:
                self._write_hosts()

    def _drop(self, key: tuple[str, str]) -> None:
        e = self.entries.pop(key)
        for p in e.proxies:
            p.stop()
        self.release_ip(e.ip)

    def _write_hosts(self) -> None:
        lines = [f"{e.ip} {name}.{ns}.svc.{CLUSTER_DOMAIN}\n" for (ns, name), e in sorted(self.entries.items())]
        self.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.hosts_file.with_name(f".{self.hosts_file.name}.tmp")
        tmp.write_text("".join(lines))
        os.replace(tmp, self.hosts_file)

    def stop(self) -> None:
        with self._lock:
            for key in list(self.entries):
                self._drop(key)
            self._write_hosts()
