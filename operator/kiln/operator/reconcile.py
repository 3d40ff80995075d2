"""Level-based reconcile of one InferenceEngine: observe the children, compute the desired
state with the pure builders, close the gap with server-side apply, report status.

Engine completeness: an engine ``<hash>`` is complete on a cache claim when its *engine
record* exists (a ConfigMap ``kiln-engine-<hash>-<claim>``), which the operator writes when the
build Job for that hash succeeds.  This works the same on a real cluster and on the test plane
(where kwok completes Jobs without running them), keeps no state in annotations, survives
operator restarts and the deletion of the InferenceEngine (the claim and the records are not
owned), and lets several resources share an engine.  Delete a record to force a rebuild.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from kiln.common.enginespec import BuildSpec, EngineSpecError

from . import builders as b
from . import conditions as cond
from . import constants as c
from .kube import ApiError, Kube

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


def source_text(spec: Mapping[str, Any]) -> str:
    """The model source as one string (``builtin:NAME``, ``pvc://CLAIM/PATH``, ``hf://REPO@REV``)."""
    m = spec.get("model") or {}
    if m.get("builtin"):
        return f"builtin:{m['builtin']}"
    if m.get("pvc"):
        return f"pvc://{m['pvc'].get('claimName')}/{m['pvc'].get('path', '')}"
    if m.get("huggingFace"):
        hf = m["huggingFace"]
        return f"hf://{hf.get('repo')}" + (f"@{hf['revision']}" if hf.get("revision") else "")
    return ""


class Reconciler:
    """Reconciles InferenceEngines through a ``Kube``.  ``scaler`` (optional) answers the
    builtin autoscaler's wish: ``scaler(key) -> (replicas | None, status dict | None)``."""

    def __init__(self, kube: Kube, config: ReconcilerConfig | None = None,
                 scaler: Callable[[str], tuple[int | None, dict | None]] | None = None):
        self.kube = kube
        self.config = config or ReconcilerConfig()
        self.scaler = scaler or (lambda key: (None, None))

    # --- the reconcile ------------------------------------------------------------------------
    def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        """Close the gap for one InferenceEngine ``body`` (as last seen).  Raises ``ApiError``
        on API failures (the controller retries with backoff)."""
        meta = body["metadata"]
        owner = {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}
        key = f"{owner['namespace']}/{owner['name']}"
        out = Outcome(key=key)
        if meta.get("deletionTimestamp"):
            return out  # owner references garbage-collect the children
        spec = body.get("spec") or {}
        old_status = body.get("status") or {}
        generation = int(meta.get("generation") or 0)
        now = cond.now_rfc3339()
        suspended = bool(spec.get("suspend"))
        scaling = b.autoscaling(spec)
        status: Obj = {"observedGeneration": generation, "selector": b.selector_string(owner),
                       "endpoint": b.endpoint(owner), "model": source_text(spec)}

        try:
            bs = BuildSpec.from_dict(spec)
            rt = spec.get("runtime") or {}
            # kiln serve refuses to serve past an engine's build limits: every pod would crash
            for rt_field, build_field, limit in (("maxModelLen", "maxSeqLen", bs.max_seq_len),
                                                 ("maxNumSeqs", "maxBatchSize", bs.max_batch_size),
                                                 ("maxNumBatchedTokens", "maxNumTokens", bs.max_num_tokens)):
                v = rt.get(rt_field)
                if isinstance(v, int) and not isinstance(v, bool) and v > limit:
                    raise EngineSpecError(f"runtime.{rt_field} {v} is larger than build.{build_field} {limit}: an "
                                          f"engine serves at most the limits it was built for")
        except EngineSpecError as e:
            status.update(phase=c.PHASE_DEGRADED, replicas=0, readyReplicas=0)
            status["conditions"] = cond.merge_conditions(old_status.get("conditions"), [
                cond.Condition(c.COND_ENGINE_BUILT, "False", "InvalidSpec", str(e)),
                cond.Condition(c.COND_AVAILABLE, "False", "InvalidSpec", str(e)),
                cond.Condition(c.COND_PROGRESSING, "False", "InvalidSpec", str(e)),
                cond.Condition(c.COND_DEGRADED, "True", "InvalidSpec", str(e)),
            ], generation, now)
            out.phase = c.PHASE_DEGRADED
            out.body = self._write_status(body, owner, old_status, status, now)
            out.status_written = out.body is not None
            return out
        h = bs.hash()
        out.hash = h
        status["engineHash"] = h
        ns = owner["namespace"]
        stor = b.storage(spec)
        degraded: tuple[str, str] | None = None

        # 1. The engine cache claim (created if missing, never owned, never rewritten).
        if self.kube.get("v1", "PersistentVolumeClaim", ns, stor["claimName"]) is None:
            if stor["create"]:
                self.kube.apply(b.cache_claim(spec, owner))
                out.applied.append("PersistentVolumeClaim")
            else:
                degraded = ("ClaimNotFound", f"engine cache claim {stor['claimName']} does not exist")

        # 2. The engine: a record says it is complete; otherwise a build Job makes it.
        record = self.kube.get("v1", "ConfigMap", ns, b.record_name(stor["claimName"], h))
        built = record is not None
        jname = b.job_name(owner, h)
        jobs = self.kube.list("batch/v1", "Job", ns, label_selector=(
            f"{c.LABEL_ENGINE}={owner['name'][:63]},{c.LABEL_COMPONENT}={c.COMPONENT_BUILD}"))
        job = next((j for j in jobs if j["metadata"]["name"] == jname), None)
        for other in jobs:  # builds of hashes no longer wanted are stopped, finished ones kept
            if other is not job and job_state(other)[0] in ("Pending", "Running") \
                    and not other["metadata"].get("deletionTimestamp"):
                self.kube.delete("batch/v1", "Job", ns, other["metadata"]["name"])
        state, jreason, jmessage = job_state(job)
        build_status: Obj = {"jobName": jname}
        if job:
            js = job.get("status") or {}
            for k_from, k_to in (("startTime", "startTime"), ("completionTime", "completionTime")):
                if js.get(k_from):
                    build_status[k_to] = js[k_from]
            if js.get("failed"):
                build_status["failedAttempts"] = int(js["failed"])
        if built:
            build_status["state"] = "Succeeded" if job and state == "Succeeded" else "Cached"
            if not job:
                build_status = {"state": "Cached", "jobName": record.get("data", {}).get("builtBy", "")}
        elif state == "Succeeded":
            self.kube.apply(b.engine_record(spec, h, owner, jname, job.get("status", {}).get("completionTime") or now))
            out.applied.append("ConfigMap")
            built = True
            build_status["state"] = "Succeeded"
        elif state == "Failed":
            build_status["state"] = "Failed"
            build_status["message"] = f"{jreason}: {jmessage}".strip(": ")
            degraded = degraded or ("BuildFailed", f"build Job {jname} failed: {jreason}"
                                    + (f": {jmessage}" if jmessage else ""))
        elif suspended:
            if job and not job["metadata"].get("deletionTimestamp"):
                self.kube.delete("batch/v1", "Job", ns, jname)
            build_status = {"state": "Pending", "jobName": jname, "message": "suspended"}
        else:
            if job is None and degraded is None:
                self.kube.apply(b.build_job(spec, h, owner, self.config.default_image))
                out.applied.append("Job")
            build_status["state"] = state
            build_status["message"] = f"building engine {h} with {bs.quantization}"
        status["build"] = build_status
        out.built = built

        # 3. The Deployment: the new engine only once it exists; until then the old one stays.
        dname = b.deployment_name(owner)
        dep = self.kube.get("apps/v1", "Deployment", ns, dname)
        serving = None
        if dep is not None:
            serving = ((dep["spec"]["template"]["metadata"].get("labels") or {}).get(c.LABEL_ENGINE_HASH))
        target = h if built else (serving if suspended and dep is not None else None)
        if target is not None:
            replicas = self._replicas(key, spec, scaling, suspended, dep)
            dep = self.kube.apply(b.deployment(spec, target, owner, replicas=replicas,
                                               default_image=self.config.default_image))
            out.applied.append("Deployment")
            serving = target
        out.serving_hash = serving
        if serving:
            status["servingEngineHash"] = serving

        # 4. The Service (always: the endpoint is stable before the first pod is ready).
        self.kube.apply(b.service(spec, owner))
        out.applied.append("Service")

        # 5. The autoscaler: exactly one owner of replicas.
        if dep is not None:
            if scaling["mode"] == "hpa" and not suspended:
                self.kube.apply(b.hpa(spec, owner))
                out.applied.append("HorizontalPodAutoscaler")
            else:
                self.kube.delete("autoscaling/v2", "HorizontalPodAutoscaler", ns, dname)
        if scaling["mode"] == "builtin" and not suspended:
            _, scaler_status = self.scaler(key)
            if scaler_status:
                status["autoscaler"] = scaler_status

        # 6. Status.
        ds = (dep or {}).get("status") or {}
        dspec_replicas = int(((dep or {}).get("spec") or {}).get("replicas") or 0)
        out.replicas = dspec_replicas if dep is not None else None
        ready = int(ds.get("readyReplicas") or 0)
        status["replicas"] = int(ds.get("replicas") or 0)
        status["readyReplicas"] = ready
        rolled = dep is not None and int(ds.get("observedGeneration") or 0) >= int(dep["metadata"].get("generation") or 0) \
            and int(ds.get("updatedReplicas") or 0) == dspec_replicas and int(ds.get("replicas") or 0) == dspec_replicas \
            and ready == dspec_replicas
        conds: list[cond.Condition] = []
        if built:
            conds.append(cond.Condition(c.COND_ENGINE_BUILT, "True",
                                        "BuildSucceeded" if build_status.get("state") == "Succeeded" else "EngineCached",
                                        f"engine {h} is complete"))
        elif state == "Failed":
            conds.append(cond.Condition(c.COND_ENGINE_BUILT, "False", "BuildFailed", build_status.get("message", "")))
        elif suspended:
            conds.append(cond.Condition(c.COND_ENGINE_BUILT, "False", "Suspended", "builds are stopped while suspended"))
        else:
            conds.append(cond.Condition(c.COND_ENGINE_BUILT, "False", "Building", f"build Job {jname} is {state.lower()}"))
        if suspended:
            conds.append(cond.Condition(c.COND_AVAILABLE, "False", "Suspended", "scaled to zero"))
        elif ready > 0:
            conds.append(cond.Condition(c.COND_AVAILABLE, "True", "MinimumReplicasAvailable",
                                        f"{ready}/{dspec_replicas} replicas ready"))
        else:
            conds.append(cond.Condition(c.COND_AVAILABLE, "False",
                                        "NoReadyReplicas" if dep is not None else "EngineNotBuilt",
                                        "no serving replica is ready" if dep is not None else "waiting for the engine"))
        if degraded:
            conds.append(cond.Condition(c.COND_PROGRESSING, "False", degraded[0], degraded[1]))
        elif not built and not suspended:
            conds.append(cond.Condition(c.COND_PROGRESSING, "True", "Building", f"building engine {h}"))
        elif dep is not None and not rolled and not suspended:
            conds.append(cond.Condition(c.COND_PROGRESSING, "True", "RollingOut",
                                        f"{int(ds.get('updatedReplicas') or 0)}/{dspec_replicas} replicas updated"))
        else:
            conds.append(cond.Condition(c.COND_PROGRESSING, "False", "ReconcileComplete", "desired state reached"))
        conds.append(cond.Condition(c.COND_DEGRADED, "True", *degraded) if degraded
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
        status["phase"] = phase
        status["conditions"] = cond.merge_conditions(old_status.get("conditions"), conds, generation, now)
        out.phase = phase
        out.body = self._write_status(body, owner, old_status, status, now)
        out.status_written = out.body is not None
        return out

    def _replicas(self, key: str, spec: Mapping[str, Any], scaling: Mapping[str, Any],
                  suspended: bool, dep: Mapping[str, Any] | None) -> int | None:
        if suspended:
            return 0
        mode = scaling["mode"]
        if mode == "hpa":
            return None
        if mode == "builtin":
            want, _ = self.scaler(key)
            if want is None:
                current = ((dep or {}).get("spec") or {}).get("replicas")
                want = int(current) if current else int(scaling["minReplicas"])
            return max(int(scaling["minReplicas"]), min(int(scaling["maxReplicas"]), want))
        return int(spec.get("replicas", 1))

    def _write_status(self, body: Mapping[str, Any], owner: Mapping[str, Any], old: Mapping[str, Any],
                      new: Obj, now: str) -> Obj | None:
        if _same(old, new):
            return None
        obj = {"apiVersion": c.API_VERSION, "kind": c.KIND,
               "metadata": {"name": owner["name"], "namespace": owner["namespace"]}, "status": new}
        result = self.kube.apply(obj, subresource="status")
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
