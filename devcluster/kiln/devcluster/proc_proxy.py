"""A tiny kube-proxy for one Service of the test plane: a local TCP port that forwards each
connection to one of the Service's ready endpoints (from its EndpointSlices), round robin.

Test infrastructure (the plane has no kube-proxy and the pods' loopback IPs are not behind a
ClusterIP).  Like kube-proxy it routes only to endpoints whose ``conditions.ready`` is true,
as the EndpointSlice controller last wrote them (polled every ``poll_seconds``; with no
endpoints there, e.g. loopback pod IPs that the controller refuses, the Service's Ready pods).  Unlike
iptables it retries the TCP connect on another ready endpoint when one refuses (nothing has
been sent yet, so that is always safe), which is what a load balancer with health checks does.
With ``poll_seconds=0`` it reads the endpoints for each new connection instead of polling (no
background API calls; a Service that changed is seen by the next connection).  ``endpoints``
fixes the endpoints instead (a Service without EndpointSlices, such as ``default/kubernetes``
of a plane whose API server does not write its own).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading

from kiln.devcluster.wait import wait_for

log = logging.getLogger("proc_proxy")


class ServiceProxy:
    """``ServiceProxy(core_v1_api, namespace, service).start()`` -> ``.url`` (http://127.0.0.1:PORT).

    Args:
        port_name: the Service port to forward to (None: the first one of each EndpointSlice).
        listen_host / listen_port: where to listen (port 0: a free one).
        poll_seconds: how often the endpoints are read (0: for each new connection instead).
        endpoints: fixed ``(host, port)`` endpoints, never read from the API server.
    """

    def __init__(self, api, namespace: str, service: str, port_name: str | None = None,
                 listen_host: str = "127.0.0.1", listen_port: int = 0, poll_seconds: float = 0.2,
                 endpoints: list[tuple[str, int]] | None = None):
        from kubernetes import client
        self.discovery = client.DiscoveryV1Api(api.api_client)
        self.core = api
        self.namespace, self.service, self.port_name = namespace, service, port_name
        self.poll_seconds = poll_seconds
        self.fixed = list(endpoints) if endpoints is not None else None
        self.endpoints: list[tuple[str, int]] = list(self.fixed or [])
        self._rr = itertools.count()
        self._stop = threading.Event()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((listen_host, listen_port))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{listen_host}:{self.port}"
        self.num_connections = 0
        self.num_connect_retries = 0
        self._threads: list[threading.Thread] = []

    def refresh(self) -> list[tuple[str, int]]:
        if self.fixed is not None:
            return self.endpoints
        slices = self.discovery.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.service}").items
        eps = []
        for s in slices:
            ports = [p for p in (s.ports or []) if self.port_name is None or p.name == self.port_name]
            if not ports:
                continue
            for ep in s.endpoints or []:
                cond = ep.conditions
                if cond is not None and cond.ready is False:
                    continue
                if cond is not None and cond.terminating:
                    continue
                eps += [(addr, ports[0].port) for addr in ep.addresses]
        if not eps:
            eps = self._ready_pods()
        self.endpoints = sorted(eps)
        return self.endpoints

    def _ready_pods(self) -> list[tuple[str, int]]:
        """Fallback when the EndpointSlice controller wrote no endpoints (it refuses loopback pod
        IPs, which a process node without CAP_NET_ADMIN hands out): the Service's Ready pods."""
        svc = self.core.read_namespaced_service(self.service, self.namespace)
        if not svc.spec.selector:
            return []
        sel = ",".join(f"{k}={v}" for k, v in svc.spec.selector.items())
        port = next((p for p in svc.spec.ports or [] if self.port_name is None or p.name == self.port_name), None)
        if port is None:
            return []
        out = []
        for pod in self.core.list_namespaced_pod(self.namespace, label_selector=sel).items:
            ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
            if not ready or pod.metadata.deletion_timestamp or not pod.status.pod_ip:
                continue
            target = port.target_port if port.target_port is not None else port.port
            if isinstance(target, str) and not target.isdigit():
                target = next((cp.container_port for c in pod.spec.containers for cp in c.ports or []
                               if cp.name == target), None)
            if target is not None:
                out.append((pod.status.pod_ip, int(target)))
        return out

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001
                log.debug("endpoint refresh failed: %s", e)

    def _pick_and_connect(self) -> socket.socket | None:
        if self.poll_seconds <= 0:
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - the endpoints last read
                log.debug("endpoint refresh failed: %s", e)
        eps = list(self.endpoints)
        if not eps:
            return None
        start = next(self._rr)
        for i in range(len(eps)):
            addr = eps[(start + i) % len(eps)]
            try:
                return socket.create_connection(addr, timeout=5)
            except OSError:
                self.num_connect_retries += 1
        return None

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _handle(self, client: socket.socket) -> None:
        upstream = self._pick_and_connect()
        if upstream is None:
            client.close()
            return
        upstream.settimeout(None)
        self.num_connections += 1
        t = threading.Thread(target=self._pump, args=(upstream, client), daemon=True)
        t.start()
        self._pump(client, upstream)
        t.join()
        client.close()
        upstream.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(c,), daemon=True).start()

    def start(self) -> "ServiceProxy":
        try:
            self.refresh()
        except Exception:  # noqa: BLE001
            pass
        loops = (self._poll, self._accept) if self.poll_seconds > 0 and self.fixed is None else (self._accept,)
        self._threads = [threading.Thread(target=fn, daemon=True, name=f"proxy-{fn.__name__}") for fn in loops]
        for t in self._threads:
            t.start()
        return self

    def wait_endpoints(self, n: int = 1, stall: float = 60, progress=None) -> list[tuple[str, int]]:
        """Waits for n ready endpoints; fails after stall seconds in which neither the endpoints
        nor progress() (e.g. ``Stack.progress``) changed."""
        try:
            wait_for(f"{n} ready endpoints", lambda: len(self.refresh()) >= n, stall=stall, interval=0.3,
                     progress=lambda: (tuple(self.endpoints), progress() if progress else None))
        except TimeoutError as e:
            raise TimeoutError(f"{self.namespace}/{self.service}: fewer than {n} ready endpoints ({e})") from None
        return self.endpoints

    def stop(self) -> None:
        """Stops accepting and polling, and waits for the poller's current API call: a daemon
        thread inside a TLS call while the interpreter exits can crash it (SIGABRT)."""
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        for t in self._threads:
            t.join(timeout=15)
