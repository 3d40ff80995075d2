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

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from kiln.common.progress import BuildProgress
from kiln.common.tensorparallel import ParallelShape, tensor_parallel_problem

from . import adapters as ad
from . import builders as b
from . import builders_autoscaling as ba
from . import conditions as cond
from . import constants as c
from . import diagnose
from . import idle as idl
from .diagnose import Problem, job_state  # noqa: F401  (job_state re-exported)
from .buildplan import ChildRef, _Build, _plan_build, _plan_draft  # noqa: F401  (ChildRef re-exported)
from .builders_gateway import EPP_ROLE
from .exposure import POOL, SCALED, plan_exposure  # noqa: F401  (POOL: the reconciler's)
from .spec import InferenceEngineSpec, InvalidSpec

Obj = dict[str, Any]


@dataclass(frozen=True)
class ScalerWish:
    """The builtin autoscaler's answer for one engine: desired replicas (None: no opinion
    yet) and its ``status.autoscaler`` (None: nothing to report)."""

    replicas: int | None = None
    status: Mapping[str, Any] | None = None
    last_active: str | None = None  # RFC 3339: a scrape last saw a pod schedule requests


@dataclass(frozen=True)
class Peer:
    """An InferenceEngine of the namespace as far as the build Jobs care: who it is, which
    engine it needs on which claim, and whether it is suspended (then it needs no build)."""

    owner: Mapping[str, Any]
    claim: str
    hash: str
    suspended: bool = False
    draft_hash: str | None = None  # its draft engine (runtime.speculative method draft)

    @property
    def hashes(self) -> tuple[str, ...]:
        """The engines it needs: its own and its draft's."""
        return (self.hash,) + ((self.draft_hash,) if self.draft_hash else ())


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
        record: the engine record of the spec's hash on that claim (None: not complete; a
            record the engine cache cleanup is deleting counts as none).
        cleanup_active: an engine cache cleanup Job of the claim is pending or running (no
            build starts meanwhile).
        jobs: the build Jobs of the engine cache claim (shared: one per engine hash).
        build_pods: the pods of the spec's build Job (read while it is not complete).
        build_progress: the last progress line of the running build pod's log (None: none yet).
        peers: the InferenceEngines of the namespace (this one included) and the engine each
            needs: who owns a shared build Job and which builds are still wanted.
        deployment: the serving Deployment, or None.
        serving_pods: the Deployment's pods.
        wish: the builtin autoscaler's wish (mode ``builtin`` only).
        last_request: the Kiln router's ``kiln.dev/last-request-time`` annotation (scale to zero).
        created: the resource's ``metadata.creationTimestamp``.
        refused: children the API server refused in this reconcile's act.
        draft_record / draft_build_pods / draft_build_progress: as ``record``, ``build_pods``
            and ``build_progress``, for the draft engine of ``runtime.speculative`` (method
            ``draft``; its own hash and build Job on the same claim).
        adapter_jobs / adapter_job_pods: this resource's adapter fetch Jobs, and the pods of
            the failed ones (their termination messages).
        pod_adapters: the ready serving pods and the adapters each serves (LoRA on only).
        lora_results: the pods' answers to this reconcile's load/unload calls.
        served: the optional kinds (``exposure.OPTIONAL_KINDS``, ``(apiVersion, kind)``) that
            discovery found served, of those the spec asks for or the status lists.
        pool_uid: the uid of the engine's InferencePool (None: none yet).
    """

    owner: Mapping[str, Any]
    generation: int = 0
    status: Mapping[str, Any] = field(default_factory=dict)
    claim_exists: bool = False
    record: Mapping[str, Any] | None = None
    cleanup_active: bool = False
    jobs: tuple[Mapping[str, Any], ...] = ()
    build_pods: tuple[Mapping[str, Any], ...] = ()
    build_progress: BuildProgress | None = None
    peers: tuple[Peer, ...] = ()
    deployment: Mapping[str, Any] | None = None
    serving_pods: tuple[Mapping[str, Any], ...] = ()
    wish: ScalerWish = field(default_factory=ScalerWish)
    last_request: str | None = None
    created: str | None = None
    refused: tuple[Refusal, ...] = ()
    draft_record: Mapping[str, Any] | None = None
    draft_build_pods: tuple[Mapping[str, Any], ...] = ()
    draft_build_progress: BuildProgress | None = None
    adapter_jobs: tuple[Mapping[str, Any], ...] = ()
    adapter_job_pods: tuple[Mapping[str, Any], ...] = ()
    pod_adapters: tuple[ad.PodAdapters, ...] = ()
    lora_results: tuple[ad.LoRAResult, ...] = ()
    served: frozenset[tuple[str, str]] = frozenset()
    pool_uid: str | None = None


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
        lora_ops: LoRA adapter loads and unloads to call on ready pods (after the apply).
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
    lora_ops: tuple[ad.LoRAOp, ...] = ()

    def manifest(self, kind: str) -> Obj | None:
        """The manifest of ``kind`` this plan applies, or None."""
        return next((o for o in self.apply if o["kind"] == kind), None)


def plan(spec: InferenceEngineSpec | InvalidSpec, observed: Observed, now: str, *,
         default_image: str = c.DEFAULT_RUNTIME_IMAGE, epp_role: tuple[str, str] = EPP_ROLE) -> Plan:
    """The plan that closes the gap between ``spec`` and ``observed``.  ``now`` (RFC 3339)
    stamps condition transitions and a record whose Job has no completion time;
    ``default_image`` is the runtime image when ``spec.image`` is empty; ``epp_role`` the role
    an endpoint picker is bound to (``spec.gateway.inferencePool``)."""
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
    build = _plan_build(spec, observed, h, degraded, now, default_image, spec.engine_hashes)
    apply += build.apply
    draft = _plan_draft(spec, observed, degraded, now, default_image)
    if draft is not None:
        apply += draft.apply
    degraded = degraded or build.degraded or (draft.degraded if draft is not None else None)
    built = build.built and (draft is None or draft.built)  # the pods need both engines
    tp_problem = _tensor_parallel_problem(spec, build.record) if built else None
    if tp_problem is not None:  # every pod would exit at start: no rollout, the old pods keep serving
        degraded = degraded or tp_problem

    dep = observed.deployment
    serving = _engine_hash_of(dep)
    target = h if built and tp_problem is None else (serving if spec.suspend and dep is not None else None)
    lora = ad.plan_adapters(spec, owner, observed.adapter_jobs, observed.adapter_job_pods, observed.pod_adapters,
                            observed.lora_results, build.built, h, default_image)
    apply += lora.apply  # the adapter list before the Deployment: its pods mount it
    desired = None
    idle = _idle(spec, observed, now)
    if target is not None:
        desired = b.deployment(spec, target, owner, replicas=_replicas(spec, observed, idle),
                               default_image=default_image)
        apply.append(desired)
        serving = target
    apply.append(b.service(spec, owner))
    exposure = plan_exposure(spec, owner, observed.status, observed.served, desired is not None or dep is not None,
                             observed.pool_uid, epp_role)
    apply += exposure.apply  # spec.gateway and the ScaledObject: after the Deployment and Service
    after = _deployment_after(dep, desired)
    delete = list(dict.fromkeys(list(build.delete) + list(draft.delete if draft else ())))
    delete += [ChildRef("batch/v1", "Job", owner["namespace"], n) for n in lora.delete]
    delete += [ChildRef(av, kind, owner["namespace"], n) for av, kind, n in exposure.delete]
    if after is not None:  # exactly one owner of replicas
        if spec.autoscaling.mode == "hpa" and not spec.suspend:
            apply.append(ba.hpa(spec, owner))
        else:
            delete.append(ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", owner["namespace"],
                                   b.deployment_name(owner)))
    recheck = build.recheck
    if idle is not None and idle.active and after is not None:  # scale to zero when the window ends
        recheck = _sooner(recheck, idle.seconds_left)
    if observed.refused:  # the API server's word beats anything planned from what it refused
        r = observed.refused[0]
        degraded = Problem(f"{r.kind}Rejected", f"{r.kind} {r.name} was refused by the API server: "
                                                f"{r.reason}: {r.message}")
    if degraded is None and after is not None and not spec.suspend:
        degraded = diagnose.deployment_problem(dep)
        if degraded is None:
            degraded, wait = diagnose.pods_problem(observed.serving_pods, now)
            recheck = _sooner(recheck, wait)
        if degraded is None:  # the base serves: an adapter's failure is what is wrong
            degraded = lora.problem
        recheck = _sooner(recheck, lora.recheck)

    status, phase = _status(spec, observed, build, degraded, after, serving, now, draft, exposure.conditions, idle)
    status.update(exposure.status)
    if lora.status is not None:
        status["adapters"], status["pods"] = lora.status, lora.pods
    return Plan(apply=tuple(apply), delete=tuple(delete), owners=build.owners + (draft.owners if draft else ()),
                status=status, phase=phase, hash=h, built=built, serving_hash=serving,
                replicas=None if after is None else int(after["spec"].get("replicas") or 0),
                requeue_after=None if degraded is not None else recheck,
                lora_ops=lora.ops if after is not None and not spec.suspend else ())


def _tensor_parallel_problem(spec: InferenceEngineSpec, record: Mapping[str, Any] | None) -> Problem | None:
    """``runtime.tensorParallelSize`` against the built engine's shape (its record's
    ``shape``, from the build's report): ``TensorParallelSizeInvalid`` when ``kiln serve``
    would refuse it at start.  None when it fits or the record has no shape (a record written
    before the build reported one: kiln serve checks it, exit 2)."""
    tp = spec.runtime.tensor_parallel_size
    if tp == 1 or record is None:
        return None
    try:
        shape = ParallelShape.from_dict(json.loads((record.get("data") or {}).get("shape") or "null"))
    except ValueError:
        shape = None
    problem = tensor_parallel_problem(shape, tp, "runtime.tensorParallelSize") if shape is not None else None
    if problem is None:
        return None
    return Problem("TensorParallelSizeInvalid", f"engine {spec.engine_hash}: {problem}")


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


def _engine_hash_of(dep: Mapping[str, Any] | None) -> str | None:
    """The engine hash a Deployment's pods run (its pod-template label)."""
    if dep is None:
        return None
    return (dep["spec"]["template"]["metadata"].get("labels") or {}).get(c.LABEL_ENGINE_HASH)


def _idle(spec: InferenceEngineSpec, observed: Observed, now: str) -> idl.IdleState | None:
    """Where an engine that scales to zero stands (None for one that does not): ``idle.py``."""
    if not spec.autoscaling.scales_to_zero or spec.suspend:
        return None
    return idl.engine_idle(spec.autoscaling, (observed.last_request, observed.wish.last_active, observed.created),
                           observed.serving_pods, observed.deployment, now)


def _replicas(spec: InferenceEngineSpec, observed: Observed, idle: idl.IdleState | None = None) -> int | None:
    """The Deployment's ``spec.replicas``; None leaves them to the HPA.  An engine that
    scales to zero has 0 when idle, at least 1 otherwise."""
    if spec.suspend:
        return 0
    scaling = spec.autoscaling
    if scaling.mode == "hpa":
        return None
    if scaling.mode == "keda":  # KEDA's HPA owns them; without KEDA the engine serves minReplicas
        return None if SCALED in observed.served else scaling.min_replicas
    if scaling.mode == "builtin":
        want = observed.wish.replicas
        if want is None:
            current = ((observed.deployment or {}).get("spec") or {}).get("replicas")
            want = int(current) if current else scaling.min_replicas
        if idle is not None:
            return 0 if not idle.active else max(1, min(scaling.max_replicas, want))
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
                after: Obj | None, h: str, idle: idl.IdleState | None = None) -> tuple[list[cond.Condition], str]:
    """The four conditions and the phase.  An engine scaled to zero while idle is
    available (the router holds its requests while it scales up) and Ready once at zero."""
    ds = (after or {}).get("status") or {}
    want = int(((after or {}).get("spec") or {}).get("replicas") or 0)
    ready = int(ds.get("readyReplicas") or 0)
    rolled = after is not None and int(ds.get("observedGeneration") or 0) >= int(after["metadata"].get("generation") or 0) \
        and int(ds.get("updatedReplicas") or 0) == want and int(ds.get("replicas") or 0) == want and ready == want
    suspended, built = spec.suspend, build.built
    zero = idle is not None and not idle.active and built and after is not None and want == 0
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
    elif zero:
        available = cond.Condition(c.COND_AVAILABLE, "True", "ScaledToZero",
                                   f"idle since {idle.last_used}: scaled to zero; a request through the Kiln "
                                   "router scales it up")
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
    elif (ready > 0 or zero) and rolled:
        phase = c.PHASE_READY
    else:
        phase = c.PHASE_DEPLOYING
    return [engine, available, progressing, degraded_cond], phase


def _engine_status(h: str, record: Mapping[str, Any]) -> Obj:
    """``status.engine``: the engine's hash, size on disk and accuracy (from its record)."""
    data = record.get("data") or {}
    out: Obj = {"hash": h}
    if str(data.get("sizeBytes") or "").isdigit():
        out["sizeBytes"] = int(data["sizeBytes"])
    if data.get("accuracy"):
        try:
            out["accuracy"] = json.loads(data["accuracy"])
        except ValueError:
            pass
    return out


def _draft_status(h: str, draft: _Build) -> Obj:
    """``status.engine.draft``: the draft engine's hash, its build's state and its size."""
    out: Obj = {"hash": h, "state": draft.status.get("state", draft.state), "jobName": draft.status.get("jobName", "")}
    if draft.status.get("message"):
        out["message"] = draft.status["message"]
    if draft.record is not None:
        out.update({k: v for k, v in _engine_status(h, draft.record).items() if k == "sizeBytes"})
    return out


def _status(spec: InferenceEngineSpec, observed: Observed, build: _Build, degraded: Problem | None,
            after: Obj | None, serving: str | None, now: str, draft: _Build | None = None,
            extra: tuple[cond.Condition, ...] = (), idle: idl.IdleState | None = None) -> tuple[Obj, str]:
    """Step 5: the status to write, and its phase (``draft``: the draft engine's build;
    ``extra``: conditions of the exposure step; ``idle``: scale to zero's state)."""
    h = spec.engine_hash
    status = _base_status(observed, spec.model.text)
    status["engineHash"] = h
    status["build"] = build.status
    if build.record is not None:
        status["engine"] = _engine_status(h, build.record)
    gate, gate_hash = build, h  # the build the conditions speak of: the target's, then the draft's
    if draft is not None:
        status.setdefault("engine", {})["draft"] = _draft_status(spec.draft_hash, draft)
        if build.built:
            gate, gate_hash = draft, spec.draft_hash
    if serving:
        status["servingEngineHash"] = serving
    if spec.autoscaling.mode == "builtin" and not spec.suspend and observed.wish.status:
        status["autoscaler"] = dict(observed.wish.status)
    if idle is not None and idle.last_used is not None:
        status.setdefault("autoscaler", {})["lastActivityTime"] = idle.last_used
    ds = (after or {}).get("status") or {}
    status["replicas"] = int(ds.get("replicas") or 0)
    status["readyReplicas"] = int(ds.get("readyReplicas") or 0)
    status["ready"] = f"{status['readyReplicas']}/{int(((after or {}).get('spec') or {}).get('replicas') or 0)}"
    conditions, phase = _conditions(spec, gate, degraded, after, gate_hash, idle)
    status["phase"] = phase
    status["conditions"] = cond.merge_conditions(observed.status.get("conditions"), conditions + list(extra),
                                                 observed.generation, now)
    return status, phase
