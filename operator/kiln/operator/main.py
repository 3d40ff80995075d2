"""``kiln operator``: kopf handlers (thin: they feed the controller) and the command line.

Entry points:
    run(argv) -> int                 # ``kiln operator [--namespace NS ...] [--kubeconfig F] ...``
    start_in_thread(options) -> RunningOperator   # tests and benchmarks: the operator in-process

kopf is used for watching (list + watch with reconnects), login and the liveness endpoint;
the controller does the work.  No kopf state is written to resources: only ``@kopf.on.event``
handlers are registered (no progress/diff-base annotations, no finalizers), peering is off
(a Lease elects the single active replica instead).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import constants as c
from .autoscaler import BuiltinAutoscaler, MetricsFetcher, http_fetcher
from .controller import Controller, ControllerConfig
from .enginegc import GcSettings
from .kube import Kube, KubeConfig, connection_info
from .leader import LeaderElector, LeaseConfig
from .builders_gateway import EPP_ROLE
from .reconcile import ReconcilerConfig

log = logging.getLogger("kiln.operator")

CHILD_LABELS = {c.LABEL_MANAGED_BY: c.MANAGED_BY}


@dataclass
class OperatorOptions:
    """Everything ``kiln operator`` can be told (flags map 1:1, see ``parse_args``).

    Fields:
        namespaces: namespaces to watch; empty means cluster-wide.
        kubeconfig / context: credentials (default: in-cluster, then ``$KUBECONFIG``).
        default_image: runtime image for engines without ``spec.image``.
        leader_election: elect one active replica with a Lease.
        lease_namespace / lease_name / identity: the Lease and this replica's name.
        liveness_endpoint: kopf's health endpoint, e.g. ``http://0.0.0.0:8081/healthz``.
        health_port: port of ``/healthz`` and ``/readyz`` (0: off), served from before the
            Lease is won so standbys stay alive.
        workers / resync_seconds / autoscale_seconds: controller loop settings.
        metrics_fetcher: how the builtin autoscaler reads a pod's metrics (tests inject one).
        engine_gc_seconds / engine_retention_seconds / engine_cache_min_free: the engine cache
            lifecycle (``enginegc.py``).
        endpoint_picker_role: ``(kind, name)`` of the role endpoint pickers are bound to.
        router_namespace / router_selector: the Kiln router's pods, read by the builtin
            autoscaler for ``autoscaling.metric: routerQueue`` (empty selector: none).
        build_progress_seconds: while a build runs, its pod's log is read this often for
            ``status.build``'s progress.
    """

    namespaces: list[str] = field(default_factory=list)
    kubeconfig: str | None = None
    context: str | None = None
    default_image: str = c.DEFAULT_RUNTIME_IMAGE
    leader_election: bool = True
    lease_namespace: str | None = None
    lease_name: str = "kiln-operator"
    identity: str | None = None
    liveness_endpoint: str | None = None
    health_port: int = 0
    workers: int = 8
    resync_seconds: float = 60.0
    autoscale_seconds: float = 15.0
    metrics_fetcher: MetricsFetcher | None = None
    engine_gc_seconds: float = 300.0
    engine_retention_seconds: float = 7 * 86400.0
    engine_cache_min_free: int = 0
    endpoint_picker_role: tuple[str, str] = EPP_ROLE
    router_namespace: str = ""
    router_selector: str = ""
    build_progress_seconds: float = 10.0


def parse_args(argv: Sequence[str]) -> OperatorOptions:
    """Parse ``kiln operator`` flags.  Environment defaults: ``KILN_WATCH_NAMESPACES``
    (comma-separated), ``KILN_RUNTIME_IMAGE``, ``POD_NAMESPACE``, ``POD_NAME``."""
    p = argparse.ArgumentParser(prog="kiln operator", description="Run the Kiln operator (kopf).")
    p.add_argument("--namespace", "-n", action="append", default=None,
                   help="namespace to watch (repeatable); default: all namespaces")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="watch all namespaces")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--context", default=None, help="kubeconfig context")
    p.add_argument("--runtime-image", default=os.environ.get("KILN_RUNTIME_IMAGE", c.DEFAULT_RUNTIME_IMAGE),
                   help="runtime image for engines without spec.image")
    p.add_argument("--no-leader-election", action="store_true", help="act without holding the Lease")
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE"),
                   help="namespace of the leader Lease (default: $POD_NAMESPACE or the first watched namespace)")
    p.add_argument("--lease-name", default="kiln-operator", help="name of the leader Lease")
    p.add_argument("--identity", default=os.environ.get("POD_NAME"), help="this replica's identity")
    p.add_argument("--liveness", default=None, help="kopf's health endpoint, e.g. http://0.0.0.0:8081/healthz")
    p.add_argument("--health-port", type=int, default=0,
                   help="serve /healthz and /readyz on this port (0: off)")
    p.add_argument("--workers", type=int, default=8, help="concurrent reconciles")
    p.add_argument("--resync-seconds", type=float, default=60.0, help="periodic full resync")
    p.add_argument("--autoscale-seconds", type=float, default=15.0, help="builtin autoscaler interval")
    p.add_argument("--engine-gc-seconds", type=float, default=300.0,
                   help="how often unused engines are looked for on the engine cache claims (0: never)")
    p.add_argument("--engine-retention-seconds", type=float, default=7 * 86400.0,
                   help="an engine no InferenceEngine has used for this long is deleted from its claim "
                        "(0: kept; default: 7 days)")
    p.add_argument("--engine-cache-min-free", type=_bytes, default=0, metavar="SIZE",
                   help="unused engines are deleted, oldest first, while a claim has less free space "
                        "(bytes, or 500Mi, 20Gi...; 0: never for space)")
    p.add_argument("--endpoint-picker-role", type=_role, default=EPP_ROLE, metavar="KIND/NAME",
                   help="the role endpoint pickers of spec.gateway.inferencePool are bound to "
                        "(ClusterRole/NAME or Role/NAME; default ClusterRole/kiln-endpoint-picker)")
    p.add_argument("--router-namespace", default=os.environ.get("POD_NAMESPACE", ""),
                   help="namespace of the Kiln router's pods (default: $POD_NAMESPACE)")
    p.add_argument("--router-selector", default="",
                   help="label selector of the Kiln router's pods, whose /metrics the builtin autoscaler "
                        "reads for autoscaling.metric routerQueue (default: none)")
    p.add_argument("--build-progress-seconds", type=float, default=10.0,
                   help="while a build runs, its pod's log is read this often for status.build's progress")
    p.add_argument("--log-level", default=os.environ.get("KILN_LOG_LEVEL", "INFO"))
    a = p.parse_args(list(argv))
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.log_level.upper() != "DEBUG":
        logging.getLogger("kopf").setLevel(logging.WARNING)  # kopf logs every handler call at INFO
    env_ns = [n for n in os.environ.get("KILN_WATCH_NAMESPACES", "").split(",") if n]
    namespaces = [] if a.all_namespaces else (a.namespace or env_ns)
    return OperatorOptions(
        namespaces=namespaces, kubeconfig=a.kubeconfig, context=a.context,
        default_image=a.runtime_image, leader_election=not a.no_leader_election,
        lease_namespace=a.lease_namespace, lease_name=a.lease_name, identity=a.identity,
        liveness_endpoint=a.liveness, health_port=a.health_port, workers=a.workers, resync_seconds=a.resync_seconds,
        autoscale_seconds=a.autoscale_seconds, engine_gc_seconds=a.engine_gc_seconds,
        engine_retention_seconds=a.engine_retention_seconds, engine_cache_min_free=a.engine_cache_min_free,
        endpoint_picker_role=a.endpoint_picker_role, router_namespace=a.router_namespace,
        router_selector=a.router_selector, build_progress_seconds=a.build_progress_seconds)


_UNITS = {"": 1, "k": 1000, "M": 1000 ** 2, "G": 1000 ** 3, "T": 1000 ** 4,
          "Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3, "Ti": 1024 ** 4}


def _role(text: str) -> tuple[str, str]:
    """``ClusterRole/NAME`` or ``Role/NAME`` as ``(kind, name)``."""
    kind, _, name = text.partition("/")
    if kind not in ("ClusterRole", "Role") or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not ClusterRole/NAME or Role/NAME")
    return kind, name


def _bytes(text: str) -> int:
    """A size in bytes: an integer with an optional Kubernetes suffix (k, M, G, T, Ki, Mi, Gi, Ti)."""
    num = text.rstrip("kMGTi")
    unit = text[len(num):]
    if not num.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or e.g. 500Mi, 20Gi)")
    return int(num) * _UNITS[unit]


def build_registry(controller: Controller, kube: Kube):
    """A kopf registry with the operator's handlers, bound to ``controller``."""
    import kopf

    reg = kopf.OperatorRegistry()

    @kopf.on.login(registry=reg)
    def login(**_: Any):
        return connection_info(kube.configuration)

    @kopf.on.startup(registry=reg)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.peering.standalone = True
        settings.posting.enabled = False
        settings.scanning.disabled = True
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.process.ultimate_exiting_timeout = None
        controller.start()

    @kopf.on.cleanup(registry=reg)
    async def cleanup(**_: Any) -> None:
        await controller.stop()

    @kopf.on.event(c.GROUP, c.VERSION, c.PLURAL, registry=reg)
    async def engine_event(event: dict, body: Any, **_: Any) -> None:
        controller.observe_engine(event.get("type"), body)

    @kopf.on.event("batch", "v1", "jobs", labels=CHILD_LABELS, registry=reg)
    async def job_event(body: Any, **_: Any) -> None:
        controller.observe_child(body)

    @kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS, registry=reg)
    async def deployment_event(body: Any, **_: Any) -> None:
        controller.observe_child(body)

    @kopf.on.event("", "v1", "pods", labels=CHILD_LABELS, registry=reg)
    async def pod_event(body: Any, **_: Any) -> None:
        controller.observe_pod(body)

    return reg


class Stopper:
    """A thread-safe stop request for kopf.  kopf waits for a ``threading.Event`` stop flag
    in an executor thread that never ends if kopf stops for another reason (SIGTERM), which
    keeps the process alive; an ``asyncio.Event`` set through ``call_soon_threadsafe`` does not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self.requested = False

    def attach(self) -> asyncio.Event:
        """Called inside the running loop: the event to hand to kopf."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
            if self.requested:
                self._event.set()
            return self._event

    def set(self) -> None:
        """Request a stop (from any thread)."""
        with self._lock:
            self.requested = True
            if self._loop is not None and self._event is not None:
                try:
                    self._loop.call_soon_threadsafe(self._event.set)
                except RuntimeError:  # the loop is already closed
                    pass


async def operate(opts: OperatorOptions, kube: Kube, controller: Controller,
                  stopper: Stopper | None = None, ready_flag: Any = None) -> None:
    """Run kopf with the operator's registry until ``stopper`` is set or a signal arrives."""
    import kopf

    settings = kopf.OperatorSettings()
    settings.process.ultimate_exiting_timeout = None
    stop_flag = (stopper or Stopper()).attach()
    await kopf.operator(
        registry=build_registry(controller, kube), settings=settings, standalone=True,
        clusterwide=not opts.namespaces, namespaces=opts.namespaces,
        liveness_endpoint=opts.liveness_endpoint, stop_flag=stop_flag, ready_flag=ready_flag)


def make_controller(opts: OperatorOptions, kube: Kube) -> Controller:
    """The controller for ``opts``."""
    return Controller(
        kube, ReconcilerConfig(default_image=opts.default_image, pods_loopback_only=not _in_cluster(opts),
                               epp_role=opts.endpoint_picker_role, progress_seconds=opts.build_progress_seconds),
        ControllerConfig(workers=opts.workers, resync_seconds=opts.resync_seconds,
                         autoscale_seconds=opts.autoscale_seconds, engine_gc_seconds=opts.engine_gc_seconds,
                         router_namespace=opts.router_namespace or opts.lease_namespace or "",
                         router_selector=opts.router_selector),
        BuiltinAutoscaler(fetcher=opts.metrics_fetcher or http_fetcher(loopback_only=not _in_cluster(opts))),
        GcSettings(retention_seconds=opts.engine_retention_seconds, min_free_bytes=opts.engine_cache_min_free,
                   image=opts.default_image))


def _in_cluster(opts: OperatorOptions) -> bool:
    """Running in a pod with in-cluster credentials (pod IPs are routable)."""
    return opts.kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST")) \
        and os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token")


def _elector(opts: OperatorOptions, kube: Kube) -> LeaderElector:
    ns = opts.lease_namespace or (opts.namespaces[0] if opts.namespaces else "default")
    ident = opts.identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return LeaderElector(kube, LeaseConfig(name=opts.lease_name, namespace=ns, identity=ident))


def run(argv: Sequence[str] | None = None) -> int:
    """``kiln operator``: parse flags, win the leader Lease, run until SIGTERM.  Returns the
    exit code: 0 on a clean stop, 1 when leadership was lost (the pod restarts as a standby)."""
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    kube = Kube(KubeConfig(kubeconfig=opts.kubeconfig, context=opts.context,
                           pool_size=opts.workers + 8))
    elector = _elector(opts, kube) if opts.leader_election else None
    ready = threading.Event()
    controller = make_controller(opts, kube)
    if opts.health_port:
        from .health import serve_health
        serve_health(opts.health_port, ready.is_set, alive=controller.alive, metrics=controller.metrics_text)
    if elector is not None:
        log.info("waiting for the leader Lease %s/%s", elector.cfg.namespace, elector.cfg.name)
        if not elector.acquire():
            return 0
    log.info("leading: watching %s", ", ".join(opts.namespaces) or "all namespaces")
    lost = threading.Event()
    stop = Stopper()
    if elector is not None:
        elector.keep(lambda: (lost.set(), stop.set()))
    try:
        asyncio.run(operate(opts, kube, controller, stopper=stop, ready_flag=ready))
    except KeyboardInterrupt:
        pass
    finally:
        if elector is not None:
            elector.release()
        kube.close()
    return 1 if lost.is_set() else 0


@dataclass
class RunningOperator:
    """An operator running in a background thread (``start_in_thread``)."""

    thread: threading.Thread
    stop_flag: Stopper
    ready_flag: threading.Event
    controller: Controller
    kube: Kube
    elector: LeaderElector | None
    errors: list = field(default_factory=list)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop kopf and the controller, release the Lease, join the thread."""
        self.stop_flag.set()
        if self.elector is not None:
            self.elector.stop.set()
        self.thread.join(timeout)
        if self.elector is not None:
            self.elector.release()
        self.kube.close()


def start_in_thread(opts: OperatorOptions, wait_ready: float = 60.0) -> RunningOperator:
    """Start the operator in a daemon thread (leader election included when enabled: the
    thread waits for the Lease).  Returns once kopf is ready (or after ``wait_ready`` s when
    still waiting for the Lease)."""
    kube = Kube(KubeConfig(kubeconfig=opts.kubeconfig, context=opts.context, pool_size=opts.workers + 8))
    controller = make_controller(opts, kube)
    stop, ready = Stopper(), threading.Event()
    elector = _elector(opts, kube) if opts.leader_election else None
    handle = RunningOperator(threading.Thread(), stop, ready, controller, kube, elector)

    def main() -> None:
        try:
            if elector is not None:
                if not elector.acquire():
                    return
                elector.keep(stop.set)
            asyncio.run(operate(opts, kube, controller, stopper=stop, ready_flag=ready))
        except BaseException as e:  # noqa: BLE001 - surfaced to the test
            handle.errors.append(e)
            log.exception("operator thread failed")

    handle.thread = threading.Thread(target=main, name="kiln-operator", daemon=True)
    handle.thread.start()
    ready.wait(wait_ready)
    return handle


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
