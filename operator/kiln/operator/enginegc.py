"""The engine cache lifecycle: engines no InferenceEngine uses leave the claim.

The operator cannot reach a claim's files, so a short cleanup Job does it (``kiln engines gc``
on the claim, ``kiln.common.enginecache.collect``); the operator decides what it deletes, from
the engine records (one ConfigMap per engine and claim) and the resources that use each engine.
Every ``engine_gc_seconds`` (``EngineJanitor.run_once``), per namespace and claim:

1. Each record gets ``usedBy`` (the resources whose spec or serving pods use the engine) and,
   while nobody uses it, the annotation ``kiln.dev/unused-since``.
2. With no build of the claim pending or running and no cleanup running: the engines unused
   for ``retention_seconds`` are *expired*; with ``min_free_bytes``, the other unused ones are
   *spare*, oldest first.  Their records are marked ``kiln.dev/deleting`` (a marked record is
   neither served nor rebuilt: ``reconcile.observe``), the users are read again (one that
   started using an engine meanwhile unmarks it), and one cleanup Job deletes the expired
   engines and, while the claim has less than ``min_free_bytes`` free, the spare ones.
3. When that Job has finished, the records of the engines it deleted are deleted (its report is
   its termination message), the others unmarked, the sizes it measured written to the
   records, and the Job deleted.  No build starts while a cleanup runs (``plan._plan_build``).

An engine in use is never deleted, nor one that a build is writing: the cleanup runs only
while no build of the claim does, so a build's temporary folder it finds is a killed build's
leftover, deleted with its engine (``kiln engines gc --no-build-running``); run by hand
without that flag, ``collect`` skips a hash with such a folder.  ``plan_gc`` is pure; ``EngineJanitor`` reads and acts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Iterable, Mapping

from kiln.common.enginecache import GcReport

from . import builders as b
from . import constants as c
from .plan import job_state
from .spec import EngineSpecError, parse_spec
from .speculative import LABEL_DRAFT_ENGINE_HASH

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class GcSettings:
    """Operator-wide cache settings (``kiln operator`` flags).

    Fields:
        retention_seconds: an engine unused this long is deleted; 0 keeps unused engines.
        min_free_bytes: unused engines are deleted, oldest first, while the claim has less
            free; 0 never deletes for space.
        image / image_pull_policy: the cleanup Job's image (the runtime image: it has ``kiln``).
    """

    retention_seconds: float = 7 * 86400
    min_free_bytes: int = 0
    image: str = c.DEFAULT_RUNTIME_IMAGE
    image_pull_policy: str = "IfNotPresent"


@dataclass
class GcPlan:
    """What to do for one claim: apply ``records`` (full desired records), delete the records
    ``delete_records`` and the Jobs ``delete_jobs``, then create ``job`` (None: no cleanup now)."""

    records: list[Obj] = field(default_factory=list)
    delete_records: list[str] = field(default_factory=list)
    delete_jobs: list[str] = field(default_factory=list)
    job: Obj | None = None


def _parse_time(s: str | None) -> datetime | None:
    try:
        return datetime.strptime(s or "", "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None


def _record(rec: Mapping[str, Any], data: Mapping[str, str], annotations: Mapping[str, str | None]) -> Obj:
    """``rec`` as a full desired record with ``data`` and ``annotations`` changed (None drops one)."""
    meta = rec["metadata"]
    ann = {**(meta.get("annotations") or {}), **annotations}
    out_meta: Obj = {"name": meta["name"], "namespace": meta["namespace"], "labels": dict(meta.get("labels") or {})}
    ann = {k: v for k, v in ann.items() if v is not None and (k.startswith("kiln.dev/"))}
    if ann:
        out_meta["annotations"] = ann
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": out_meta,
            "data": {**(rec.get("data") or {}), **data}}


def _hash_of(rec: Mapping[str, Any]) -> str:
    return (rec.get("data") or {}).get("engineHash", "")


def plan_gc(namespace: str, claim: str, records: Iterable[Mapping[str, Any]], users: Mapping[str, list[str]],
            builds_active: bool, cleanups: Iterable[tuple[Mapping[str, Any], GcReport | None]], now: str,
            settings: GcSettings) -> GcPlan:
    """The cleanup step of one claim (see the module doc).

    Args:
        records: the claim's engine records.
        users: engine hash -> the resources using it (``namespace/name``).
        builds_active: a build Job of the claim is pending or running.
        cleanups: the claim's cleanup Jobs with their report (None until one exists).
        now: RFC 3339, the clock of this step.
    """
    out = GcPlan()
    records = list(records)
    active = False
    done: GcReport | None = None
    for job, report in cleanups:
        state = job_state(job)[0]
        if state in ("Pending", "Running"):
            active = True
        else:
            out.delete_jobs.append(job["metadata"]["name"])
            if state == "Succeeded" and report is not None:
                done = report
    t_now = _parse_time(now)
    expired: list[tuple[str, str]] = []  # (unused since, hash)
    spare: list[tuple[str, str]] = []
    for rec in records:
        h, ann = _hash_of(rec), rec["metadata"].get("annotations") or {}
        data = {"usedBy": ",".join(sorted(users.get(h, [])))}
        if done is not None and h in done.engines:
            data["sizeBytes"] = str(done.engines[h])
        changes: dict[str, str | None] = {}
        if ann.get(c.ANNOTATION_DELETING) and not active:  # its cleanup has finished
            if done is not None and h in done.removed:
                out.delete_records.append(rec["metadata"]["name"])
                continue
            changes[c.ANNOTATION_DELETING] = None
        if users.get(h):
            changes[c.ANNOTATION_UNUSED_SINCE] = None
            if ann.get(c.ANNOTATION_DELETING) and active:
                changes[c.ANNOTATION_DELETING] = None  # in use again: never deleted (collect may have; rebuilt)
        else:
            since = ann.get(c.ANNOTATION_UNUSED_SINCE) or now
            changes.setdefault(c.ANNOTATION_UNUSED_SINCE, since)
            t = _parse_time(since)
            if not ann.get(c.ANNOTATION_DELETING) and t is not None and t_now is not None:
                old = settings.retention_seconds > 0 and t_now - t >= timedelta(seconds=settings.retention_seconds)
                (expired if old else spare).append((since, h))
        new = _record(rec, data, changes)
        if new != _record(rec, {}, {}):
            out.records.append(new)
    if active or builds_active:
        return out
    remove = [h for _, h in sorted(expired)]
    keep_free = [h for _, h in sorted(spare)] if settings.min_free_bytes > 0 else []
    if not remove and not keep_free:
        return out
    marked = set(remove) | set(keep_free)
    by_name = {r["metadata"]["name"]: r for r in out.records}
    for rec in records:
        if _hash_of(rec) in marked:
            base = by_name.get(rec["metadata"]["name"]) or _record(rec, {}, {})
            base["metadata"].setdefault("annotations", {})[c.ANNOTATION_DELETING] = "pending"
            if rec["metadata"]["name"] not in by_name:
                out.records.append(base)
    out.job = gc_job(namespace, claim, remove, keep_free, settings)
    name = out.job["metadata"]["name"]
    for rec in out.records:
        if (rec["metadata"].get("annotations") or {}).get(c.ANNOTATION_DELETING) == "pending":
            rec["metadata"]["annotations"][c.ANNOTATION_DELETING] = name
    return out


def gc_job(namespace: str, claim: str, remove: list[str], spare: list[str], settings: GcSettings) -> Obj:
    """The cleanup Job: ``kiln engines gc`` on the claim, its report in the termination message."""
    digest = hashlib.sha256(json.dumps([claim, remove, spare]).encode()).hexdigest()[:8]
    name = b.child_name(f"kiln-gc-{claim}"[:45].rstrip("-."), digest)
    labels = {c.LABEL_NAME: c.APP_NAME, c.LABEL_COMPONENT: c.COMPONENT_GC, c.LABEL_MANAGED_BY: c.MANAGED_BY,
              c.LABEL_PART_OF: "kiln", c.LABEL_CACHE_CLAIM: b.label_value(claim)}
    # planned only with no build of the claim pending or running, and none starts meanwhile
    args = ["gc", "--cache-dir", c.DEFAULT_CACHE_ROOT, "--no-build-running", "--termination-log", c.TERMINATION_LOG]
    if remove:
        args += ["--remove", *remove]
    if spare:
        args += ["--spare", *spare, "--min-free", str(settings.min_free_bytes)]
    container = {"name": c.CONTAINER_NAME, "image": settings.image, "imagePullPolicy": settings.image_pull_policy,
                 "command": ["kiln", "engines"], "args": args,
                 "volumeMounts": [{"name": "engines", "mountPath": c.DEFAULT_CACHE_ROOT}],
                 "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                     "capabilities": {"drop": ["ALL"]}},
                 "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                 "terminationMessagePath": c.TERMINATION_LOG, "terminationMessagePolicy": "File"}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {"backoffLimit": 0, "activeDeadlineSeconds": 1800, "ttlSecondsAfterFinished": 86400,
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "restartPolicy": "Never", "enableServiceLinks": False,
                         "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                             "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
                         "containers": [container],
                         "volumes": [{"name": "engines", "persistentVolumeClaim": {"claimName": claim}}]}}}}


def gc_report(pods: Iterable[Mapping[str, Any]]) -> GcReport | None:
    """The report of a cleanup Job from its pod's termination message, or None."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term.get("exitCode", 1) != 0:
                continue
            try:
                d = json.loads(term.get("message") or "")
                return GcReport(removed=dict(d.get("removed") or {}), kept=dict(d.get("kept") or {}),
                                free_bytes=int(d.get("free_bytes") or 0), total_bytes=int(d.get("total_bytes") or 0),
                                engines=dict(d.get("engines") or {}))
            except (ValueError, TypeError, AttributeError):
                continue
    return None


class EngineJanitor:
    """Reads what ``plan_gc`` needs through a ``Kube`` and does what it says."""

    def __init__(self, kube, settings: GcSettings):
        self.kube = kube
        self.settings = settings

    def users(self, namespace: str) -> dict[tuple[str, str], list[str]]:
        """(claim, engine hash) -> the resources using it: by their spec (suspended ones too:
        they resume), by the engine their pods serve (``status.servingEngineHash``) and by the
        Deployments' pod templates.  Read fresh from the API server."""
        out: dict[tuple[str, str], set[str]] = {}
        for ie in self.kube.list(c.API_VERSION, c.KIND, namespace):
            key = f"{namespace}/{ie['metadata']['name']}"
            try:
                spec = parse_spec(ie.get("spec") or {})
            except EngineSpecError:
                continue
            claim = spec.storage.claim_name
            for h in spec.engine_hashes:  # its engine and its draft engine (runtime.speculative)
                out.setdefault((claim, h), set()).add(key)
            serving = (ie.get("status") or {}).get("servingEngineHash")
            if serving:
                out.setdefault((claim, serving), set()).add(key)
        for dep in self.kube.list("apps/v1", "Deployment", namespace,
                                  label_selector=f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY},{c.LABEL_COMPONENT}={c.COMPONENT_SERVER}"):
            tpl = dep["spec"]["template"]
            tpl_labels = tpl["metadata"].get("labels") or {}
            for h in (tpl_labels.get(c.LABEL_ENGINE_HASH), tpl_labels.get(LABEL_DRAFT_ENGINE_HASH)):
                for v in tpl["spec"].get("volumes") or []:
                    claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
                    if h and claim and v.get("name") == "engines":
                        out.setdefault((claim, h), set()).add(f"{namespace}/deployment/{dep['metadata']['name']}")
        return {k: sorted(v) for k, v in out.items()}

    def run_once(self, namespace: str, claims: Iterable[str], now: str) -> list[GcPlan]:
        """One cleanup step for each claim of ``namespace``.  Raises ``ApiError``."""
        plans = []
        users = self.users(namespace)
        for claim in sorted(set(claims)):
            mine = {h: u for (cl, h), u in users.items() if cl == claim}
            records = self.kube.list("v1", "ConfigMap", namespace, label_selector=(
                f"{c.LABEL_COMPONENT}={c.COMPONENT_RECORD},{c.LABEL_CACHE_CLAIM}={b.label_value(claim)}"))
            builds = self.kube.list("batch/v1", "Job", namespace, label_selector=b.build_selector(claim))
            busy = any(job_state(j)[0] in ("Pending", "Running") for j in builds)
            cleanups = []
            for job in self.kube.list("batch/v1", "Job", namespace, label_selector=b.gc_selector(claim)):
                report = None
                if job_state(job)[0] == "Succeeded":
                    pods = self.kube.list("v1", "Pod", namespace, label_selector=f"job-name={job['metadata']['name']}")
                    report = gc_report(pods)
                cleanups.append((job, report))
            p = plan_gc(namespace, claim, records, mine, busy, cleanups, now, self.settings)
            self._act(namespace, p, claim)
            plans.append(p)
        return plans

    def _act(self, namespace: str, p: GcPlan, claim: str) -> None:
        """Do ``p``: the marks on the records first, then the users read again (one that
        started using a marked engine meanwhile cancels this cleanup: marks taken back, no Job),
        then the Job."""
        for name in p.delete_jobs:
            self.kube.delete("batch/v1", "Job", namespace, name)
        for name in p.delete_records:
            self.kube.delete("v1", "ConfigMap", namespace, name)
            log.info("engine record %s/%s deleted: its engine was removed from the claim", namespace, name)
        for rec in p.records:
            self.kube.apply(rec)
        if p.job is None:
            return
        args = p.job["spec"]["template"]["spec"]["containers"][0]["args"]
        marked = {_hash_of(r) for r in p.records if (r["metadata"].get("annotations") or {}).get(c.ANNOTATION_DELETING)}
        again = {h: u for (cl, h), u in self.users(namespace).items() if cl == claim}
        if any(again.get(h) for h in marked):
            log.info("engine cache cleanup of %s/%s put off: an engine it would delete is in use again", namespace, claim)
            for rec in p.records:
                ann = rec["metadata"].get("annotations") or {}
                if ann.pop(c.ANNOTATION_DELETING, None):
                    if not ann:
                        rec["metadata"].pop("annotations", None)
                    self.kube.apply(rec)
            p.job = None
            return
        self.kube.apply(p.job)
        log.info("engine cache cleanup Job %s/%s: kiln engines %s", namespace, p.job["metadata"]["name"], " ".join(args))
