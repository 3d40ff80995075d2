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

import base64
import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from kiln.common.enginespec import EngineSpecError
from kiln.common.progress import BuildProgress, last_progress

from . import adapters as ad
from . import builders as b
from . import conditions as cond
from . import constants as c
from .kube import ApiError, Kube
from .builders_gateway import EPP_ROLE
from .exposure import POOL, wanted_kinds
from .podapi import PodLoRAClient, PodUnreachable
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
        pods_loopback_only: the operator runs outside the cluster: only a local process-backed
            node's pods are called (LoRA adapters), as the builtin autoscaler scrapes them.
        progress_seconds: while a build runs, its pod's log is read this often for its
            progress (``status.build``).
        served_ttl: seconds a discovery answer (which optional APIs are served: Gateway API,
            Inference Extension, KEDA) is reused.
        epp_role: ``(kind, name)`` of the chart's role that endpoint pickers are bound to.
    """

    default_image: str = c.DEFAULT_RUNTIME_IMAGE
    emit_events: bool = True
    pods_loopback_only: bool = False
    progress_seconds: float = 10.0
    served_ttl: float = 30.0
    epp_role: tuple[str, str] = EPP_ROLE


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
        self._discovery: dict[str, tuple[float, frozenset[str]]] = {}  # apiVersion -> (when, kinds)
        self.pod_client = PodLoRAClient(loopback_only=self.config.pods_loopback_only)

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
        todo = plan(spec, observed, now, default_image=self.config.default_image, epp_role=self.config.epp_role)
        applied, refused = self.act(todo)
        pool = applied.get("InferencePool")
        if pool is not None and observed.pool_uid is None:  # created now: its endpoint picker can be owned by it
            observed = dataclasses.replace(observed, pool_uid=pool["metadata"]["uid"])
            todo = plan(spec, observed, now, default_image=self.config.default_image, epp_role=self.config.epp_role)
            more, refused_more = self.act(todo)
            applied.update({k: v for k, v in more.items() if k not in applied})
            refused += refused_more
        results = self.act_lora(todo.lora_ops, observed, spec)
        if results:  # the status says what the pods answered
            observed = dataclasses.replace(observed, lora_results=tuple(results))
        dep = applied.get("Deployment")
        if dep is not None and dep["metadata"]["name"] != b.deployment_name(owner):
            dep = None  # not built yet: the Deployment applied is the endpoint picker's
        if refused or results or (dep is not None and dep != observed.deployment):
            # The status describes the Deployment as the API server answered the apply (its
            # generation also moves on edits the plan cannot see: the server fills defaults),
            # and says which child the API server refused, in its words.
            todo = plan(spec, dataclasses.replace(observed, deployment=dep or observed.deployment,
                                                  refused=tuple(refused)), now,
                        default_image=self.config.default_image, epp_role=self.config.epp_role)
        out.hash, out.phase, out.built = todo.hash, todo.phase, todo.built
        out.serving_hash, out.replicas = todo.serving_hash, todo.replicas
        out.applied = list(applied)
        out.requeue_after = todo.requeue_after
        if (todo.status.get("build") or {}).get("state") == "Running":  # read the build's progress again
            out.requeue_after = min(out.requeue_after or self.config.progress_seconds, self.config.progress_seconds)
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
        jobs = tuple(self.kube.list("batch/v1", "Job", ns, label_selector=b.build_selector(claim)))
        record, mine, build_pods, progress = self._engine(ns, claim, spec.engine_hash, jobs)
        draft_record, draft_job, draft_pods, draft_progress = None, None, (), None
        if spec.draft_hash:  # the draft engine of runtime.speculative: built like the spec's own
            draft_record, draft_job, draft_pods, draft_progress = self._engine(ns, claim, spec.draft_hash, jobs)
        cleanup = False
        if (mine is None and record is None) or (spec.draft_hash and draft_job is None and draft_record is None):
            # a build would start: not while the claim is being cleaned
            cleanup = any(job_state(j)[0] in ("Pending", "Running") for j in self.kube.list(
                "batch/v1", "Job", ns, label_selector=b.gc_selector(claim)))
        dep = self.kube.get("apps/v1", "Deployment", ns, b.deployment_name(owner))
        serving_pods: tuple = ()
        if dep is not None:
            serving_pods = tuple(self.kube.list("v1", "Pod", ns, label_selector=b.selector_string(owner)))
        adapter_jobs: tuple = ()
        if spec.runtime.lora.enabled or seen.status.get("adapters") is not None:  # or Jobs left to delete
            adapter_jobs = tuple(self.kube.list("batch/v1", "Job", ns, label_selector=ad.adapter_selector(owner)))
        adapter_job_pods: tuple = ()
        if any(job_state(j)[0] == "Failed" for j in adapter_jobs):
            adapter_job_pods = tuple(self.kube.list("v1", "Pod", ns, label_selector=ad.adapter_selector(owner)))
        pod_adapters: tuple = ()
        if spec.runtime.lora.enabled and not spec.suspend:
            pod_adapters = self._pod_adapters(serving_pods, self._api_key(ns, spec))
        served = self._served(wanted_kinds(spec, seen.status))
        pool = None
        if spec.gateway.inference_pool is not None and POOL in served:
            pool = self.kube.get(*POOL, ns, b.deployment_name(owner))
        return dataclasses.replace(
            seen, served=served, pool_uid=(pool or {}).get("metadata", {}).get("uid"),
            claim_exists=self.kube.get("v1", "PersistentVolumeClaim", ns, claim) is not None,
            record=record, cleanup_active=cleanup, jobs=jobs, build_pods=build_pods, build_progress=progress,
            draft_record=draft_record, draft_build_pods=draft_pods, draft_build_progress=draft_progress,
            peers=self._peers(ns) if jobs else (),
            deployment=dep, serving_pods=serving_pods, wish=wish,
            last_request=(meta.get("annotations") or {}).get(c.ANNOTATION_LAST_REQUEST),
            created=meta.get("creationTimestamp"),
            adapter_jobs=adapter_jobs, adapter_job_pods=adapter_job_pods, pod_adapters=pod_adapters)

    def _engine(self, ns: str, claim: str, h: str, jobs: tuple) -> tuple[Any, Any, tuple, BuildProgress | None]:
        """Engine ``h`` on ``claim``: its record (None when missing or being deleted by the
        engine cache cleanup: neither served nor rebuilt meanwhile), its build Job among
        ``jobs``, that Job's pods while no record exists (a failure's cause, a success's
        report) and the running build's progress."""
        record = self.kube.get("v1", "ConfigMap", ns, b.record_name(claim, h))
        if record is not None and c.ANNOTATION_DELETING in (record["metadata"].get("annotations") or {}):
            record = None
        job = next((j for j in jobs if j["metadata"]["name"] == b.job_name(claim, h)), None)
        pods: tuple = ()
        if job is not None and record is None:
            pods = tuple(self.kube.list("v1", "Pod", ns, label_selector=(
                f"{b.build_selector(claim)},{c.LABEL_ENGINE_HASH}={h}")))
        progress = _build_progress(self.kube, ns, pods) if pods and job_state(job)[0] == "Running" else None
        return record, job, pods, progress

    def _served(self, kinds: Iterable[tuple[str, str]]) -> frozenset[tuple[str, str]]:
        """Which of ``kinds`` the API server serves (discovery).  A kind found is trusted for
        ``served_ttl`` seconds; a missing one is asked again at each reconcile of an engine that
        wants it, so CRDs installed later are found at once."""
        out = set()
        now = time.monotonic()
        for api_version, kind in kinds:
            hit = self._discovery.get(api_version)
            if hit is None or now - hit[0] > self.config.served_ttl or kind not in hit[1]:
                hit = (now, self.kube.served_kinds(api_version))
                self._discovery[api_version] = hit
            if kind in hit[1]:
                out.add((api_version, kind))
        return frozenset(out)

    def _api_key(self, namespace: str, spec: InferenceEngineSpec) -> str | None:
        """The pods' API key (``runtime.apiKeySecretRef``), None without one or when the
        Secret or its key is missing (the pods cannot start then either)."""
        ref = spec.runtime.api_key
        if ref is None:
            return None
        secret = self.kube.get("v1", "Secret", namespace, ref.name)
        value = ((secret or {}).get("data") or {}).get(ref.key)
        return base64.b64decode(value).decode().strip() if value else None

    def _pod_adapters(self, pods: Iterable[Mapping[str, Any]], api_key: str | None) -> tuple[ad.PodAdapters, ...]:
        """The ready serving pods and the adapters each one serves."""
        out = []
        for pod in pods:
            meta, st = pod.get("metadata") or {}, pod.get("status") or {}
            ready = any(x.get("type") == "Ready" and x.get("status") == "True" for x in st.get("conditions") or [])
            if not ready or meta.get("deletionTimestamp") or not st.get("podIP"):
                continue
            try:
                out.append(ad.PodAdapters(meta["name"], st["podIP"], self.pod_client.adapters(st["podIP"], api_key)))
            except PodUnreachable as e:
                out.append(ad.PodAdapters(meta["name"], st["podIP"], None, str(e)))
        return tuple(out)

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
                    hit = (gen, Peer(owner, spec.storage.claim_name, spec.engine_hash, spec.suspend, spec.draft_hash))
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
            if self.kube.delete(ref.api_version, ref.kind, ref.namespace, ref.name):  # False: already gone
                log.info("deleted %s %s/%s", ref.kind, ref.namespace, ref.name)
        applied: dict[str, Obj] = {}
        refused: list[Refusal] = []
        for obj in todo.apply:
            if obj["kind"] in ("Job", "ConfigMap"):  # a build starts / an engine is recorded: once each
                log.info("applying %s %s/%s", obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
            try:
                applied.setdefault(obj["kind"], self.kube.apply(obj))  # the first of a kind: the serving one
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

    def act_lora(self, ops: Iterable[ad.LoRAOp], observed: Observed,
                 spec: InferenceEngineSpec | InvalidSpec) -> list[ad.LoRAResult]:
        """Make the planned load/unload calls on the pods; returns their answers."""
        ops = list(ops)
        if not ops or isinstance(spec, InvalidSpec):
            return []
        key = self._api_key(observed.owner["namespace"], spec)
        out = []
        for op in ops:
            r = self.pod_client.call(op, key)
            level = logging.INFO if r.status == 200 else logging.WARNING
            log.log(level, "%s/%s: %s LoRA adapter %s on pod %s: %s %s", observed.owner["namespace"],
                    observed.owner["name"], op.op, op.name, op.pod, r.status, r.message)
            out.append(r)
        return out

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


def _build_progress(kube: Kube, namespace: str, pods: Iterable[Mapping[str, Any]]) -> BuildProgress | None:
    """The last progress line in the log of the newest running build pod, or None (no such
    pod, no progress line yet, or the log cannot be read: progress is best effort)."""
    running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"
               and not p["metadata"].get("deletionTimestamp")]
    if not running:
        return None
    pod = max(running, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    try:
        return last_progress(kube.log(namespace, pod["metadata"]["name"], c.CONTAINER_NAME))
    except ApiError as e:
        log.debug("log of build pod %s/%s not read: %s", namespace, pod["metadata"]["name"], e)
        return None


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
