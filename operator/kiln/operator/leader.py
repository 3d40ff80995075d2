"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go does it, so that two
operator replicas never both act: a replica runs kopf only while it holds the Lease, renews
it every ``retry_period`` seconds, and stops (the process exits, Kubernetes restarts it as a
standby) if it cannot renew within ``renew_deadline``.

Takeover is compare-and-swap on ``resourceVersion`` (PUT), creation is create-if-absent (POST),
so two candidates can never both believe they won.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass

from .kube import ApiError, Kube

log = logging.getLogger(__name__)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _fmt(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    s = s.replace("Z", "+00:00")
    try:
        return dt.datetime.fromisoformat(s)
    except ValueError:
        return None


@dataclass
class LeaseConfig:
    """Timing and identity of the election (seconds, client-go's defaults)."""

    name: str = "kiln-operator"
    namespace: str = "default"
    identity: str = "kiln-operator"
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


class LeaderElector:
    """Acquire and keep a Lease.  ``acquire()`` blocks until leader (or ``stop`` is set);
    ``keep(on_lost)`` renews in a daemon thread and calls ``on_lost`` once if leadership is lost."""

    def __init__(self, kube: Kube, cfg: LeaseConfig):
        self.kube, self.cfg = kube, cfg
        self.stop = threading.Event()
        self.is_leader = False

    def _lease(self, holder: str, rv: str | None, acquire: dt.datetime | None, transitions: int) -> dict:
        now = _now()
        meta = {"name": self.cfg.name, "namespace": self.cfg.namespace}
        if rv:
            meta["resourceVersion"] = rv
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": {"holderIdentity": holder, "leaseDurationSeconds": int(self.cfg.lease_duration),
                         "acquireTime": _fmt(acquire or now), "renewTime": _fmt(now),
                         "leaseTransitions": transitions}}

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this identity holds the Lease afterwards.  Raises nothing
        for API conflicts (False); raises ``ApiError`` for other API failures."""
        cur = self.kube.get("coordination.k8s.io/v1", "Lease", self.cfg.namespace, self.cfg.name)
        try:
            if cur is None:
                self.kube.create(self._lease(self.cfg.identity, None, None, 0))
                return True
            spec = cur.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            renewed = _parse(spec.get("renewTime")) or _parse(spec.get("acquireTime"))
            duration = float(spec.get("leaseDurationSeconds") or self.cfg.lease_duration)
            rv = cur["metadata"]["resourceVersion"]
            transitions = int(spec.get("leaseTransitions") or 0)
            if holder == self.cfg.identity:
                self.kube.replace(self._lease(holder, rv, _parse(spec.get("acquireTime")), transitions))
                return True
            expired = renewed is None or (_now() - renewed).total_seconds() > duration
            if holder and not expired:
                return False
            self.kube.replace(self._lease(self.cfg.identity, rv, None, transitions + 1))
            return True
        except ApiError as e:
            if e.status == 409:
                return False
            raise

    def acquire(self) -> bool:
        """Block until leader (True) or ``stop`` is set (False)."""
        logged = False
        while not self.stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    self.is_leader = True
                    log.info("became leader (%s/%s as %s)", self.cfg.namespace, self.cfg.name, self.cfg.identity)
                    return True
            except ApiError as e:
                log.warning("leader election: %s", e)
            if not logged:
                log.info("waiting for the leader lease %s/%s", self.cfg.namespace, self.cfg.name)
                logged = True
            self.stop.wait(self.cfg.retry_period)
        return False

    def keep(self, on_lost) -> threading.Thread:
        """Renew in a daemon thread; call ``on_lost()`` once when renewal fails for
        ``renew_deadline`` seconds or another holder took the Lease."""

        def loop() -> None:
            last_ok = time.monotonic()
            while not self.stop.wait(self.cfg.retry_period):
                try:
                    ok = self.try_acquire_or_renew()
                except Exception as e:  # noqa: BLE001
                    log.warning("lease renewal failed: %s", e)
                    ok = False
                if ok:
                    last_ok = time.monotonic()
                elif time.monotonic() - last_ok > self.cfg.renew_deadline or self._taken():
                    self.is_leader = False
                    log.error("lost the leader lease %s/%s", self.cfg.namespace, self.cfg.name)
                    on_lost()
                    return

        t = threading.Thread(target=loop, name="kiln-lease", daemon=True)
        t.start()
        return t

    def _taken(self) -> bool:
        try:
            cur = self.kube.get("coordination.k8s.io/v1", "Lease", self.cfg.namespace, self.cfg.name)
        except ApiError:
            return False
        return bool(cur) and (cur.get("spec") or {}).get("holderIdentity") not in (None, "", self.cfg.identity)

    def release(self) -> None:
        """Stop renewing and hand the Lease back (empty holder) so a standby takes over at once."""
        self.stop.set()
        if not self.is_leader:
            return
        try:
            cur = self.kube.get("coordination.k8s.io/v1", "Lease", self.cfg.namespace, self.cfg.name)
            if cur and (cur.get("spec") or {}).get("holderIdentity") == self.cfg.identity:
                lease = self._lease("", cur["metadata"]["resourceVersion"], None,
                                    int((cur.get("spec") or {}).get("leaseTransitions") or 0))
                lease["spec"]["leaseDurationSeconds"] = 1
                self.kube.replace(lease)
        except ApiError as e:
            log.warning("lease release failed: %s", e)
        self.is_leader = False
