"""The build's part of a plan (``plan.plan``, step 2): the engine record and the shared build
Job of one engine on the cache claim, for the spec's engine and for the draft engine of
``runtime.speculative``.  Pure, as the planner: no I/O, no clock."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from . import builders as b
from . import constants as c
from . import diagnose
from .diagnose import Problem, job_state
from .spec import InferenceEngineSpec
from .speculative import draft_build_spec

if TYPE_CHECKING:
    from .plan import Observed

Obj = dict[str, Any]


@dataclass(frozen=True)
class ChildRef:
    """A child to delete."""

    api_version: str
    kind: str
    namespace: str
    name: str


@dataclass(frozen=True)
class _Build:
    """The build's part of a plan."""

    built: bool  # the spec's engine is complete (or becomes so with this plan's record)
    state: str  # the build Job's state (job_state)
    status: Obj  # status.build
    degraded: Problem | None
    apply: tuple[Obj, ...] = ()
    delete: tuple[ChildRef, ...] = ()
    owners: tuple[tuple[ChildRef, tuple[Obj, ...]], ...] = ()
    recheck: float | None = None
    record: Mapping[str, Any] | None = None  # the engine record (as observed, or as applied now)


def _job_hash(job: Mapping[str, Any]) -> str:
    return ((job.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ENGINE_HASH, "")


def _plan_draft(spec: InferenceEngineSpec, observed: Observed, degraded: Problem | None, now: str,
                default_image: str) -> _Build | None:
    """Step 2 for the draft engine of ``runtime.speculative`` (method ``draft``): built like the
    spec's own engine, by its own shared Job, into its own engine record.  None without one."""
    dspec = draft_build_spec(spec)
    if dspec is None:
        return None
    seen = dataclasses.replace(observed, record=observed.draft_record, build_pods=observed.draft_build_pods,
                               build_progress=observed.draft_build_progress)
    out = _plan_build(dspec, seen, spec.draft_hash, degraded, now, default_image, spec.engine_hashes)
    if out.degraded is not None:
        out = dataclasses.replace(out, degraded=Problem(out.degraded.reason, f"draft model: {out.degraded.message}"))
    return out


def _plan_build(spec: InferenceEngineSpec, observed: Observed, h: str, degraded: Problem | None,
                now: str, default_image: str, own: tuple[str, ...] = ()) -> _Build:
    """Step 2: the engine record and the shared build Job of engine ``h`` on the claim
    (``own``: every engine this resource needs, ``h`` among them).

    One Job per (claim, engine hash), owned by every resource that needs it; a resource stops
    a running build only when no resource of the namespace needs that engine any more, so no
    resource deletes another's Job."""
    owner, claim = observed.owner, spec.storage.claim_name
    jname = b.job_name(claim, h)
    job = next((j for j in observed.jobs if j["metadata"]["name"] == jname), None)
    wanted = {x for p in observed.peers if p.claim == claim and not p.suspended for x in p.hashes}
    if not spec.suspend:
        wanted.update(own or (h,))
    delete = [ChildRef("batch/v1", "Job", owner["namespace"], other["metadata"]["name"]) for other in observed.jobs
              if other is not job and _job_hash(other) not in wanted
              and job_state(other)[0] in ("Pending", "Running") and not other["metadata"].get("deletionTimestamp")]
    # who owns the Job: every resource that needs engine h on this claim
    needers = {p.owner["uid"]: p.owner for p in observed.peers
               if p.claim == claim and h in p.hashes and not p.suspended}
    if not spec.suspend:
        needers[owner["uid"]] = owner
    owners: tuple[tuple[ChildRef, tuple[Obj, ...]], ...] = ()
    if job is not None and needers and not job["metadata"].get("deletionTimestamp"):
        refs = b.build_owner_refs(list(needers.values()))
        have = sorted(r.get("uid", "") for r in job["metadata"].get("ownerReferences") or [])
        if have != sorted(needers):
            owners = ((ChildRef("batch/v1", "Job", owner["namespace"], jname), tuple(refs)),)
    state, reason, message = job_state(job)
    st: Obj = {"jobName": jname}
    if job:
        js = job.get("status") or {}
        for key in ("startTime", "completionTime"):
            if js.get(key):
                st[key] = js[key]
        if js.get("failed"):
            st["failedAttempts"] = int(js["failed"])
    if observed.record is not None:
        if not job:
            st = {"state": "Cached", "jobName": (observed.record.get("data") or {}).get("builtBy", "")}
        else:
            st["state"] = "Succeeded" if state == "Succeeded" else "Cached"
        return _Build(True, state, st, None, delete=tuple(delete), owners=owners, record=observed.record)
    if state == "Succeeded":
        st["state"] = "Succeeded"
        record = b.engine_record(spec, h, owner, jname, (job.get("status") or {}).get("completionTime") or now,
                                 report=diagnose.build_report(observed.build_pods))
        return _Build(True, state, st, None, apply=(record,), delete=tuple(delete), owners=owners,
                      record=record)
    if state == "Failed":
        cause = diagnose.failed_build_cause(observed.build_pods)
        st["state"] = "Failed"
        st["message"] = "; ".join(x for x in (f"{reason}: {message}".strip(": "), cause) if x)
        failed = Problem(diagnose.build_failure_reason(cause), f"build Job {jname} failed: {st['message']}")
        return _Build(False, state, st, failed, delete=tuple(delete), owners=owners)
    if spec.suspend:
        if job and not job["metadata"].get("deletionTimestamp") and not needers:
            delete.append(ChildRef("batch/v1", "Job", owner["namespace"], jname))
        return _Build(False, state, {"state": "Pending", "jobName": jname, "message": "suspended"}, None,
                      delete=tuple(delete), owners=owners)
    st["state"] = state
    st["message"] = (f"fetching EAGLE head {h}" if spec.engine.command == ("head",)
                     else f"building engine {h} with {spec.engine.quantization}")
    if state == "Running" and observed.build_progress is not None:  # the build's own word on where it is
        st.update(observed.build_progress.to_status())
        st["message"] += f": {observed.build_progress.message}"
    problem, recheck = diagnose.pods_problem(observed.build_pods, now) if job else (None, None)
    if problem is not None:
        problem = Problem(f"Build{problem.reason}", f"build Job {jname}: {problem.message}")
        st["message"] = problem.message
    if job is None and observed.cleanup_active:  # the cleanup may be deleting this very engine
        st["message"] = "waiting for the engine cache cleanup Job of the claim to finish"
    start = job is None and degraded is None and not observed.cleanup_active
    apply = (b.build_job(spec, h, list(needers.values()), default_image),) if start else ()
    return _Build(False, state, st, problem, apply=apply, delete=tuple(delete), owners=owners, recheck=recheck)
