"""Level-based reconcile of one InferenceEngine as observe -> plan -> act.

``Reconciler.reconcile(body)`` parses the spec once (``spec.parse_spec``), reads the cluster
into an ``Observed`` (``observe``), asks the pure planner what to do (``plan.plan``: child
manifests, deletions, the status with its conditions) and does it (``act``): deletions, then
every child through the one server-side-apply writer (``kube.Kube.apply``), then the status
when it changed, with an Event per condition transition.

Engine completeness: an engine ``<hash>`` is complete on a cache claim when its *engine
record* exists (a ConfigMap ``kiln-engine-<hash>-<claim>``), which the operator writes when the
build Job for that hash succeeds.  This works the same on a real cluster and on the test plane
(where kwok completes Jobs without running them), keeps no state in annotations, survives
operator restarts and the deletion of the InferenceEngine (the claim and the records are not
owned), and lets several resources share an engine.  Delete a record to force a rebuild.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from kiln.common.enginespec import EngineSpecError

from . import builders as b
from . import conditions as cond
from . import constants as c
from .kube import ApiError, Kube
from .plan import Observed, Peer, Plan, Refusal, ScalerWish, job_state, plan
from .spec import InferenceEngineSpec, InvalidSpec, parse_spec, source_text

__all__ = ["ReconcilerConfig", "Outcome", "Reconciler", "job_state"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass
class ReconcilerConfig:
    """Operator-wide settings of the reconciler.

    Fields:
        default_image: runtime image when ``spec.image`` is empty.
        emit_events: post Kubernetes Events on condition transitions.
    """

    default_image: str = c.DEFAULT_RUNTIME_IMAGE
    emit_events: bool = True


@dataclass
class Outcome:
    """What one reconcile saw and did (for the controller, the autoscaler and tests).

    Fields:
        key: ``namespace/name``.
        hash: engine hash of the spec, None when the spec is invalid.
        phase: the phase written to status.
        built: the spec's engine is complete.
        serving_hash: engine hash of the Deployment's pods, None without a Deployment.
        replicas: the Deployment's ``spec.replicas`` after the apply (None without one).
        status_written: status changed and was applied.
        body: the InferenceEngine as the status apply returned it (None when not written).
        applied: kinds applied this round.
        requeue_after: seconds after which to reconcile again with nothing else changing
            (a pending pod's grace running out), None when only an event can change the status.
    """

    key: str
    hash: str | None = None
    phase: str = c.PHASE_PENDING
    built: bool = False
    serving_hash: str | None = None
    replicas: int | None = None
    status_written: bool = False
    body: Obj | None = None
    applied: list[str] = field(default_factory=list)
    requeue_after: float | None = None


# API answers to an apply that no retry fixes: the child as planned is refused (422 Invalid,
# 400 BadRequest), or the operator may not write it (403 Forbidden).  They go to the status.
REFUSALS = (400, 403, 422)


class Reconciler:
    """Reconciles InferenceEngines through a ``Kube``.  ``scaler`` (optional) answers the
    builtin autoscaler's wish: ``scaler(key) -> (replicas | None, status dict | None)``.
    ``peers`` (optional) gives the InferenceEngines of a namespace as last seen (the
    controller's cache); without it they are listed from the API server."""

    def __init__(self, kube: Kube, config: ReconcilerConfig | None = None,
                 scaler: Callable[[str], tuple[int | None, dict | None]] | None = None,
                 peers: Callable[[str], Iterable[Mapping[str, Any]]] | None = None):
        self.kube = kube
        self.config = config or ReconcilerConfig()
        self.scaler = scaler or (lambda key: (None, None))
        self.peers = peers or (lambda ns: self.kube.list(c.API_VERSION, c.KIND, ns))
        self._peer_cache: dict[str, tuple[Any, Peer | None]] = {}  # uid -> (generation, peer)
        self._peer_lock = threading.Lock()

    def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        """Close the gap for one InferenceEngine ``body`` (as last seen).  Raises ``ApiError``
        on API failures (the controller retries with backoff)."""
        meta = body["metadata"]
        owner = {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}
        out = Outcome(key=f"{owner['namespace']}/{owner['name']}")
        if meta.get("deletionTimestamp"):
            return out  # owner references garbage-collect the children
        now = cond.now_rfc3339()
        raw = body.get("spec") or {}
        try:
            spec: InferenceEngineSpec | InvalidSpec = parse_spec(raw)
        except EngineSpecError as e:
            spec = InvalidSpec(str(e), model=source_text(raw.get("model") if isinstance(raw, Mapping) else None))
        observed = self.observe(body, spec)
        todo = plan(spec, observed, now, default_image=self.config.default_image)
        applied, refused = self.act(todo)
        dep = applied.get("Deployment")
        if refused or (dep is not None and dep != observed.deployment):
            # The status describes the Deployment as the API server answered the apply (its
            # generation also moves on edits the plan cannot see: the server fills defaults),
            # and says which child the API server refused, in its words.
            todo = plan(spec, dataclasses.replace(observed, deployment=dep or observed.deployment,
                                                  refused=tuple(refused)), now,
                        default_image=self.config.default_image)
        out.hash, out.phase, out.built = todo.hash, todo.phase, todo.built
        out.serving_hash, out.replicas = todo.serving_hash, todo.replicas
        out.applied = list(applied)
        out.requeue_after = todo.requeue_after
        out.body = self.write_status(observed, todo.status, now)
        out.status_written = out.body is not None
        if refused:
            log.warning("%s: %s %s refused: %s", out.key, refused[0].kind, refused[0].name, refused[0].message)
        forbidden = [r for r in refused if r.reason == "Forbidden"]
        if forbidden:  # a missing RBAC rule: in the status, and retried with backoff
            raise ApiError(403, "Forbidden", forbidden[0].message)
        return out

    # --- observe ---------------------------------------------------------------------------------
    def observe(self, body: Mapping[str, Any], spec: InferenceEngineSpec | InvalidSpec) -> Observed:
        """Read what ``spec`` is planned against: the engine cache claim, the engine record of
        the spec's hash, this resource's build Jobs, the Deployment, the builtin autoscaler's
        wish.  An invalid spec reads nothing."""
        meta = body["metadata"]
        owner = {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}
        seen = Observed(owner=owner, generation=int(meta.get("generation") or 0), status=body.get("status") or {})
        if isinstance(spec, InvalidSpec):
            return seen
        ns, claim = owner["namespace"], spec.storage.claim_name
        wish = ScalerWish()
        if spec.autoscaling.mode == "builtin" and not spec.suspend:
            wish = ScalerWish(*self.scaler(f"{ns}/{owner['name']}"))
        record = self.kube.get("v1", "ConfigMap", ns, b.record_name(claim, spec.engine_hash))
        jobs = tuple(self.kube.list("batch/v1", "Job", ns, label_selector=b.build_selector(claim)))
        mine = next((j for j in jobs if j["metadata"]["name"] == b.job_name(claim, spec.engine_hash)), None)
        build_pods: tuple = ()
        if mine is not None and record is None and job_state(mine)[0] != "Succeeded":
            build_pods = tuple(self.kube.list("v1", "Pod", ns, label_selector=(
                f"{b.build_selector(claim)},{c.LABEL_ENGINE_HASH}={spec.engine_hash}")))
        dep = self.kube.get("apps/v1", "Deployment", ns, b.deployment_name(owner))
        serving_pods: tuple = ()
        if dep is not None:
            serving_pods = tuple(self.kube.list("v1", "Pod", ns, label_selector=b.selector_string(owner)))
        return dataclasses.replace(
            seen,
            claim_exists=self.kube.get("v1", "PersistentVolumeClaim", ns, claim) is not None,
            record=record, jobs=jobs, build_pods=build_pods,
            peers=self._peers(ns) if jobs else (),
            deployment=dep, serving_pods=serving_pods, wish=wish)

    def _peers(self, namespace: str) -> tuple[Peer, ...]:
        """The InferenceEngines of ``namespace`` with the engine each needs (parsed once per
        generation; ones that do not parse or are being deleted need nothing)."""
        out = []
        for body in self.peers(namespace):
            meta = body.get("metadata") or {}
            if meta.get("deletionTimestamp") or meta.get("namespace") != namespace:
                continue
            uid, gen = meta.get("uid"), meta.get("generation")
            with self._peer_lock:
                hit = self._peer_cache.get(uid)
            if hit is None or hit[0] != gen:
                try:
                    spec = parse_spec(body.get("spec") or {})
                    owner = {"name": meta["name"], "namespace": namespace, "uid": uid}
                    hit = (gen, Peer(owner, spec.storage.claim_name, spec.engine_hash, spec.suspend))
                except EngineSpecError:
                    hit = (gen, None)
                with self._peer_lock:
                    self._peer_cache[uid] = hit
            if hit[1] is not None:
                out.append(hit[1])
        return tuple(out)

    def forget(self, uid: str) -> None:
        """Drop a deleted InferenceEngine from the peer cache."""
        with self._peer_lock:
            self._peer_cache.pop(uid, None)

    # --- act -------------------------------------------------------------------------------------
    def act(self, todo: Plan) -> tuple[dict[str, Obj], list[Refusal]]:
        """Delete what ``todo`` no longer wants, server-side apply its children in order, then
        set the owners of shared build Jobs.  Returns each applied kind's object as the API
        server answered, and the children it refused (``REFUSALS``: the status reports them;
        any other error is raised and retried)."""
        for ref in todo.delete:
            self.kube.delete(ref.api_version, ref.kind, ref.namespace, ref.name)
            log.info("deleted %s %s/%s", ref.kind, ref.namespace, ref.name)
        applied: dict[str, Obj] = {}
        refused: list[Refusal] = []
        for obj in todo.apply:
            if obj["kind"] in ("Job", "ConfigMap"):  # a build starts / an engine is recorded: once each
                log.info("applying %s %s/%s", obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
            try:
                applied[obj["kind"]] = self.kube.apply(obj)
            except ApiError as e:
                if e.status not in REFUSALS:
                    raise
                refused.append(Refusal(obj["kind"], obj["metadata"]["name"], e.reason, e.message))
        for ref, owners in todo.owners:
            try:
                self.kube.set_owners(ref.api_version, ref.kind, ref.namespace, ref.name, list(owners))
            except ApiError as e:
                if e.status != 404:  # a Job deleted meanwhile: the next reconcile sees it
                    raise
        return applied, refused

    def write_status(self, observed: Observed, new: Obj, now: str) -> Obj | None:
        """Apply ``new`` as the status subresource when it differs from the last one, and post
        an Event per condition transition.  Returns the InferenceEngine after the apply, None
        when nothing changed."""
        old, owner = observed.status, observed.owner
        if _same(old, new):
            return None
        obj = {"apiVersion": c.API_VERSION, "kind": c.KIND,
               "metadata": {"name": owner["name"], "namespace": owner["namespace"]}, "status": new}
        result = self.kube.apply(obj, subresource="status")
        if old.get("phase") != new.get("phase"):
            deg = cond.get(new.get("conditions"), c.COND_DEGRADED) or {}
            why = f": {deg.get('reason')}: {deg.get('message')}" if deg.get("status") == "True" else ""
            log.info("%s/%s: %s -> %s%s", owner["namespace"], owner["name"], old.get("phase") or "new",
                     new.get("phase"), why)
        if self.config.emit_events:
            self._events(owner, old.get("conditions"), new.get("conditions") or [], now)
        return result

    def _events(self, owner: Mapping[str, Any], old: Any, new: list[dict], now: str) -> None:
        known = {x.get("type") for x in old or []}
        for t in cond.transitions(old, new):
            if t["type"] not in known and t["status"] != "True":
                continue  # a first False/Unknown is the default, not news
            warning = (t["type"] == c.COND_DEGRADED and t["status"] == "True") or t["reason"] == "BuildFailed"
            suffix = hashlib.sha256(f"{owner['uid']}/{t['type']}/{t['status']}/{t['reason']}/{now}".encode()).hexdigest()[:10]
            try:
                self.kube.apply(b.event(owner, type_="Warning" if warning else "Normal", reason=t["reason"],
                                        message=f"{t['type']}={t['status']}: {t['message']}".rstrip(": "),
                                        now=now, name_suffix=suffix))
            except ApiError as e:  # events are best effort
                log.warning("event for %s/%s not posted: %s", owner["namespace"], owner["name"], e)


def _same(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Status equality, ignoring key order and int/float spelling."""
    return _norm(dict(old)) == _norm(new)


def _norm(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _norm(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x
