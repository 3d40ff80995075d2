"""The pure half of a reconcile: what the cluster looks like (``Observed``) in, what to do
about it (``Plan``) out.

``plan(spec, observed, now)`` does no I/O and reads no clock: the same inputs give the same
plan, so every phase transition is unit-tested on plain data (tests/operator/test_plan.py).
The decisions, in order:

1. The engine cache claim is created when missing (``storage.create``), otherwise its absence
   degrades the resource (``ClaimNotFound``).  It is never owned and never rewritten.
2. The engine ``<hash>`` is complete when its engine record exists; otherwise the build Job
   makes it: one Job per (claim, hash), shared and owned by every resource of the namespace
   that needs it.  A succeeded Job gets its record written, a failed one degrades the resource
   (``BuildFailed`` with the build's own termination message, no retry storm), a build pod that
   cannot start or be scheduled degrades it too; builds no resource needs any more (spec
   changes, suspensions) are stopped (finished ones are kept).
3. The Deployment serves the spec's engine only once it is complete; until then the old
   Deployment is left alone, so its pods keep serving.  Exactly one owner sets its replicas:
   ``spec.replicas``, the HPA (replicas left out) or the builtin autoscaler's wish.
4. The Service always (the endpoint is stable before the first pod is ready); the HPA in mode
   ``hpa``, deleted otherwise.
5. The status: phase, the four conditions with ``observedGeneration``, the engine hash, the
   endpoint, replicas.  It describes the Deployment as the apply leaves it.  ``Degraded`` says
   why in the words of whoever knows: the API server refusing a child (``<Kind>Rejected``),
   the Deployment controller (``ProgressDeadlineExceeded``), the kubelet (``CrashLoopBackOff``,
   ``CreateContainerConfigError`` with the container's last termination message) or the
   scheduler (``Unschedulable``, after a short grace: ``diagnose.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from . import builders as b
from . import conditions as cond
from . import constants as c
from . import diagnose
from .diagnose import Problem
from .spec import InferenceEngineSpec, InvalidSpec

Obj = dict[str, Any]


@dataclass(frozen=True)
class ScalerWish:
    """The builtin autoscaler's answer for one engine: desired replicas (None: no opinion
    yet) and its ``status.autoscaler`` (None: nothing to report)."""

    replicas: int | None = None
    status: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Peer:
    """An InferenceEngine of the namespace as far as the build Jobs care: who it is, which
    engine it needs on which claim, and whether it is suspended (then it needs no build)."""

    owner: Mapping[str, Any]
    claim: str
    hash: str
    suspended: bool = False


@dataclass(frozen=True)
class Refusal:
    """A child the API server refused (the act's answer, planned into the status)."""

    kind: str
    name: str
    reason: str  # the API server's Status reason (Invalid, Forbidden, BadRequest...)
    message: str  # the API server's message


@dataclass(frozen=True)
class Observed:
    """What one reconcile read: the InferenceEngine as last seen and its children.

    Fields:
        owner: the InferenceEngine's ``{"name", "namespace", "uid"}``.
        generation: its ``metadata.generation``.
        status: its ``status`` as last written.
        claim_exists: the engine cache claim exists.
        record: the engine record of the spec's hash on that claim (None: not complete).
        jobs: the build Jobs of the engine cache claim (shared: one per engine hash).
        build_pods: the pods of the spec's build Job (read while it is not complete).
        peers: the InferenceEngines of the namespace (this one included) and the engine each
            needs: who owns a shared build Job and which builds are still wanted.
        deployment: the serving Deployment, or None.
        serving_pods: the Deployment's pods.
        wish: the builtin autoscaler's wish (mode ``builtin`` only).
        refused: children the API server refused in this reconcile's act.
    """

    owner: Mapping[str, Any]
    generation: int = 0
    status: Mapping[str, Any] = field(default_factory=dict)
    claim_exists: bool = False
    record: Mapping[str, Any] | None = None
    jobs: tuple[Mapping[str, Any], ...] = ()
    build_pods: tuple[Mapping[str, Any], ...] = ()
    peers: tuple[Peer, ...] = ()
    deployment: Mapping[str, Any] | None = None
    serving_pods: tuple[Mapping[str, Any], ...] = ()
    wish: ScalerWish = field(default_factory=ScalerWish)
    refused: tuple[Refusal, ...] = ()


@dataclass(frozen=True)
class ChildRef:
    """A child to delete."""

    api_version: str
    kind: str
    namespace: str
    name: str


@dataclass(frozen=True)
class Plan:
    """What to do: delete ``delete``, then server-side apply ``apply`` in order, then set the
    owners of shared build Jobs (``owners``), then write ``status`` (when it differs from the
    last one).

    Fields:
        apply: child manifests (full desired state each).
        delete: children no longer wanted.
        owners: (build Job, its owner references) where the Job's owners must change: every
            resource that needs a shared Job owns it, so it outlives none of them.
        requeue_after: seconds until the status may change with nothing else changing (a
            pending pod's grace running out), None when only an event can change it.
        status: the InferenceEngine's status.
        phase: ``status.phase``.
        hash: the spec's engine hash (None for an invalid spec).
        built: that engine is complete.
        serving_hash: the engine the Deployment runs after the apply (None without one).
        replicas: the Deployment's ``spec.replicas`` after the apply (None without one).
    """

    apply: tuple[Obj, ...] = ()
    delete: tuple[ChildRef, ...] = ()
    owners: tuple[tuple[ChildRef, tuple[Obj, ...]], ...] = ()
    status: Obj = field(default_factory=dict)
    phase: str = c.PHASE_PENDING
    hash: str | None = None
    built: bool = False
    serving_hash: str | None = None
    replicas: int | None = None
    requeue_after: float | None = None

    def manifest(self, kind: str) -> Obj | None:
        """The manifest of ``kind`` this plan applies, or None."""
        return next((o for o in self.apply if o["kind"] == kind), None)


def job_state(job: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """``(state, reason, message)`` of a Job: state is Pending, Running, Succeeded or Failed;
    for Failed, reason and message come from the Job's Failed condition
    (``BackoffLimitExceeded``, ``DeadlineExceeded``...)."""
    if not job:
        return "Pending", "", ""
    st = job.get("status") or {}
    for cd in st.get("conditions") or []:
        if cd.get("status") != "True":
            continue
        if cd.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "Succeeded", cd.get("reason") or "Completed", cd.get("message") or ""
        if cd.get("type") in ("Failed", "FailureTarget"):
            return "Failed", cd.get("reason") or "Failed", cd.get("message") or ""
    if st.get("active"):
        return "Running", "", ""
    return "Pending", "", ""


def plan(spec: InferenceEngineSpec | InvalidSpec, observed: Observed, now: str, *,
         default_image: str = c.DEFAULT_RUNTIME_IMAGE) -> Plan:
    """The plan that closes the gap between ``spec`` and ``observed``.  ``now`` (RFC 3339)
    stamps condition transitions and a record whose Job has no completion time;
    ``default_image`` is the runtime image when ``spec.image`` is empty."""
    if isinstance(spec, InvalidSpec):
        return _plan_invalid(spec, observed, now)
    owner, h = observed.owner, spec.engine_hash
    apply: list[Obj] = []
    degraded: Problem | None = None
    if not observed.claim_exists:
        if spec.storage.create:
            apply.append(b.cache_claim(spec, owner))
        else:
            degraded = Problem("ClaimNotFound", f"engine cache claim {spec.storage.claim_name} does not exist")
    build = _plan_build(spec, observed, h, degraded, now, default_image)
    apply += build.apply
    degraded = degraded or build.degraded

    dep = observed.deployment
    serving = _engine_hash_of(dep)
    target = h if build.built else (serving if spec.suspend and dep is not None else None)
    desired = None
    if target is not None:
        desired = b.deployment(spec, target, owner, replicas=_replicas(spec, observed),
                               default_image=default_image)
        apply.append(desired)
        serving = target
    apply.append(b.service(spec, owner))
    after = _deployment_after(dep, desired)
    delete = list(build.delete)
    if after is not None:  # exactly one owner of replicas
        if spec.autoscaling.mode == "hpa" and not spec.suspend:
            apply.append(b.hpa(spec, owner))
        else:
            delete.append(ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", owner["namespace"],
                                   b.deployment_name(owner)))
    recheck = build.recheck
    if observed.refused:  # the API server's word beats anything planned from what it refused
        r = observed.refused[0]
        degraded = Problem(f"{r.kind}Rejected", f"{r.kind} {r.name} was refused by the API server: "
                                                f"{r.reason}: {r.message}")
    if degraded is None and after is not None and not spec.suspend:
        degraded = diagnose.deployment_problem(dep)
        if degraded is None:
            degraded, wait = diagnose.pods_problem(observed.serving_pods, now)
            recheck = _sooner(recheck, wait)

    status, phase = _status(spec, observed, build, degraded, after, serving, now)
    return Plan(apply=tuple(apply), delete=tuple(delete), owners=build.owners, status=status, phase=phase, hash=h,
                built=build.built, serving_hash=serving,
                replicas=None if after is None else int(after["spec"].get("replicas") or 0),
                requeue_after=None if degraded is not None else recheck)


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _base_status(observed: Observed, model: str) -> Obj:
    owner = observed.owner
    return {"observedGeneration": observed.generation, "selector": b.selector_string(owner),
            "endpoint": b.endpoint(owner), "model": model}


def _plan_invalid(spec: InvalidSpec, observed: Observed, now: str) -> Plan:
    """A spec the operator cannot act on: Degraded with reason InvalidSpec, nothing applied."""
    status = _base_status(observed, spec.model)
    status.update(phase=c.PHASE_DEGRADED, replicas=0, readyReplicas=0, ready="0/0")
    status["conditions"] = cond.merge_conditions(observed.status.get("conditions"), [
        cond.Condition(t, "True" if t == c.COND_DEGRADED else "False", "InvalidSpec", spec.message)
        for t in c.CONDITION_TYPES], observed.generation, now)
    return Plan(status=status, phase=c.PHASE_DEGRADED)


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


def _job_hash(job: Mapping[str, Any]) -> str:
    return ((job.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ENGINE_HASH, "")


def _plan_build(spec: InferenceEngineSpec, observed: Observed, h: str, degraded: Problem | None,
                now: str, default_image: str) -> _Build:
    """Step 2: the engine record and the shared build Job of engine ``h`` on the claim.

    One Job per (claim, engine hash), owned by every resource that needs it; a resource stops
    a running build only when no resource of the namespace needs that engine any more, so no
    resource deletes another's Job."""
    owner, claim = observed.owner, spec.storage.claim_name
    jname = b.job_name(claim, h)
    job = next((j for j in observed.jobs if j["metadata"]["name"] == jname), None)
    wanted = {p.hash for p in observed.peers if p.claim == claim and not p.suspended}
    if not spec.suspend:
        wanted.add(h)
    delete = [ChildRef("batch/v1", "Job", owner["namespace"], other["metadata"]["name"]) for other in observed.jobs
              if other is not job and _job_hash(other) not in wanted
              and job_state(other)[0] in ("Pending", "Running") and not other["metadata"].get("deletionTimestamp")]
    # who owns the Job: every resource that needs engine h on this claim
    needers = {p.owner["uid"]: p.owner for p in observed.peers
               if p.claim == claim and p.hash == h and not p.suspended}
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
        return _Build(True, state, st, None, delete=tuple(delete), owners=owners)
    if state == "Succeeded":
        st["state"] = "Succeeded"
        record = b.engine_record(spec, h, owner, jname, (job.get("status") or {}).get("completionTime") or now)
        return _Build(True, state, st, None, apply=(record,), delete=tuple(delete), owners=owners)
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
    st["message"] = f"building engine {h} with {spec.engine.quantization}"
    problem, recheck = diagnose.pods_problem(observed.build_pods, now) if job else (None, None)
    if problem is not None:
        problem = Problem(f"Build{problem.reason}", f"build Job {jname}: {problem.message}")
        st["message"] = problem.message
    apply = (b.build_job(spec, h, list(needers.values()), default_image),) if job is None and degraded is None else ()
    return _Build(False, state, st, problem, apply=apply, delete=tuple(delete), owners=owners, recheck=recheck)


def _engine_hash_of(dep: Mapping[str, Any] | None) -> str | None:
    """The engine hash a Deployment's pods run (its pod-template label)."""
    if dep is None:
        return None
    return (dep["spec"]["template"]["metadata"].get("labels") or {}).get(c.LABEL_ENGINE_HASH)


def _replicas(spec: InferenceEngineSpec, observed: Observed) -> int | None:
    """The Deployment's ``spec.replicas``; None leaves them to the HPA."""
    if spec.suspend:
        return 0
    scaling = spec.autoscaling
    if scaling.mode == "hpa":
        return None
    if scaling.mode == "builtin":
        want = observed.wish.replicas
        if want is None:
            current = ((observed.deployment or {}).get("spec") or {}).get("replicas")
            want = int(current) if current else scaling.min_replicas
        return max(scaling.min_replicas, min(scaling.max_replicas, want))
    return spec.replicas


def _deployment_after(dep: Mapping[str, Any] | None, desired: Obj | None) -> Obj | None:
    """The parts of the Deployment that the status reads, as the apply of ``desired`` leaves
    them: it exists, has the replicas asked for (the HPA's or the API server's default of 1
    when left out), and a new engine or replica count starts a new generation that its
    controller has not observed yet."""
    if desired is None:
        return None if dep is None else {"metadata": dep.get("metadata") or {}, "spec": dep.get("spec") or {},
                                         "status": dep.get("status") or {}}
    cur_spec = (dep or {}).get("spec") or {}
    generation = int(((dep or {}).get("metadata") or {}).get("generation") or 0)
    replicas = int(desired["spec"].get("replicas", cur_spec.get("replicas", 1)))
    moved = (dep is None or _engine_hash_of(dep) != _engine_hash_of(desired)
             or replicas != int(cur_spec.get("replicas") or 0))
    return {"metadata": {"generation": generation + 1 if moved else generation},
            "spec": {"replicas": replicas}, "status": (dep or {}).get("status") or {}}


def _conditions(spec: InferenceEngineSpec, build: _Build, degraded: Problem | None,
                after: Obj | None, h: str) -> tuple[list[cond.Condition], str]:
    """The four conditions and the phase."""
    ds = (after or {}).get("status") or {}
    want = int(((after or {}).get("spec") or {}).get("replicas") or 0)
    ready = int(ds.get("readyReplicas") or 0)
    rolled = after is not None and int(ds.get("observedGeneration") or 0) >= int(after["metadata"].get("generation") or 0) \
        and int(ds.get("updatedReplicas") or 0) == want and int(ds.get("replicas") or 0) == want and ready == want
    suspended, built = spec.suspend, build.built
    if built:
        engine = cond.Condition(c.COND_ENGINE_BUILT, "True",
                                "BuildSucceeded" if build.status.get("state") == "Succeeded" else "EngineCached",
                                f"engine {h} is complete")
    elif build.state == "Failed":
        engine = cond.Condition(c.COND_ENGINE_BUILT, "False", "BuildFailed", build.status.get("message", ""))
    elif suspended:
        engine = cond.Condition(c.COND_ENGINE_BUILT, "False", "Suspended", "builds are stopped while suspended")
    else:
        engine = cond.Condition(c.COND_ENGINE_BUILT, "False", "Building",
                                f"build Job {build.status['jobName']} is {build.state.lower()}")
    if suspended:
        available = cond.Condition(c.COND_AVAILABLE, "False", "Suspended", "scaled to zero")
    elif ready > 0:
        available = cond.Condition(c.COND_AVAILABLE, "True", "MinimumReplicasAvailable", f"{ready}/{want} replicas ready")
    elif after is not None:
        available = cond.Condition(c.COND_AVAILABLE, "False", "NoReadyReplicas", "no serving replica is ready")
    else:
        available = cond.Condition(c.COND_AVAILABLE, "False", "EngineNotBuilt", "waiting for the engine")
    if degraded:
        progressing = cond.Condition(c.COND_PROGRESSING, "False", degraded.reason, degraded.message)
    elif not built and not suspended:
        progressing = cond.Condition(c.COND_PROGRESSING, "True", "Building", f"building engine {h}")
    elif after is not None and not rolled and not suspended:
        progressing = cond.Condition(c.COND_PROGRESSING, "True", "RollingOut",
                                     f"{int(ds.get('updatedReplicas') or 0)}/{want} replicas updated")
    else:
        progressing = cond.Condition(c.COND_PROGRESSING, "False", "ReconcileComplete", "desired state reached")
    degraded_cond = (cond.Condition(c.COND_DEGRADED, "True", degraded.reason, degraded.message) if degraded
                     else cond.Condition(c.COND_DEGRADED, "False", "AsExpected", ""))
    if suspended:
        phase = c.PHASE_SUSPENDED
    elif degraded:
        phase = c.PHASE_DEGRADED
    elif not built:
        phase = c.PHASE_BUILDING
    elif ready > 0 and rolled:
        phase = c.PHASE_READY
    else:
        phase = c.PHASE_DEPLOYING
    return [engine, available, progressing, degraded_cond], phase


def _status(spec: InferenceEngineSpec, observed: Observed, build: _Build, degraded: Problem | None,
            after: Obj | None, serving: str | None, now: str) -> tuple[Obj, str]:
    """Step 5: the status to write, and its phase."""
    h = spec.engine_hash
    status = _base_status(observed, spec.model.text)
    status["engineHash"] = h
    status["build"] = build.status
    if serving:
        status["servingEngineHash"] = serving
    if spec.autoscaling.mode == "builtin" and not spec.suspend and observed.wish.status:
        status["autoscaler"] = dict(observed.wish.status)
    ds = (after or {}).get("status") or {}
    status["replicas"] = int(ds.get("replicas") or 0)
    status["readyReplicas"] = int(ds.get("readyReplicas") or 0)
    status["ready"] = f"{status['readyReplicas']}/{int(((after or {}).get('spec') or {}).get('replicas') or 0)}"
    conditions, phase = _conditions(spec, build, degraded, after, h)
    status["phase"] = phase
    status["conditions"] = cond.merge_conditions(observed.status.get("conditions"), conditions,
                                                 observed.generation, now)
    return status, phase
