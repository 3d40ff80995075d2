"""LoRA adapters of an InferenceEngine: the fetch Jobs, the list the pods load at start, and
the load/unload calls that keep every ready pod serving ``spec.adapters`` (pure: plain data
in, plan out; tests/operator/test_adapters.py).

The path of an adapter, as data:

1. ``spec.adapters[i]`` (``adapter_spec.AdapterSpec``) names a source; its ``key`` names the
   folder ``/engines/.adapters/<key>`` on the engine cache claim.
2. Once the engine is complete, a Job per adapter (``adapter_job``) runs ``kiln adapter fetch``:
   download, copy or (a builtin adapter) write for the engine's model, check against the engine
   (rank, shapes), write the folder atomically.  A
   failed Job keeps its failure (no retry storm) until the source changes; an adapter removed
   from the spec has its Job deleted (the folder stays, like an engine).
3. The ConfigMap ``<name>-adapters`` lists the fetched adapters ``{name: key}``; the pods mount
   it and load it at start (``kiln serve --lora-modules-file``), so a new pod is Ready with the
   adapters already in.  Its content is not in the pod template: the list changes, the pods stay.
4. Every ready pod is asked what it serves (``GET /v1/models``, observed by the reconcile); the
   plan loads what is missing and unloads what is no longer listed (``LoRAOp``), through
   ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``.
5. ``status.adapters`` (per adapter: state, the pods serving it) and ``status.pods`` (per pod:
   its adapters); a failed fetch or a load the pod refused makes ``Degraded`` with reason
   ``AdapterFailed`` (the runtime's reason in the message), while the base keeps serving.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Mapping

from kiln.common.enginespec import engine_dir

from . import builders as b
from . import constants as c
from . import diagnose
from .adapter_spec import ADAPTER_LIST_FILE, ADAPTERS_SUBPATH, AdapterSpec
from .diagnose import Problem, job_state
from .spec import ComputeResources, InferenceEngineSpec

Obj = dict[str, Any]

COMPONENT_ADAPTER = "adapter"
LABEL_ADAPTER_KEY = "kiln.dev/adapter-key"
SOURCE_MOUNT = "/adapter-source"  # where a pvc source's claim is mounted in the fetch Job
FAILED_RECHECK_S = 60.0  # a refused load is tried again this often (the pod may get the folder)
UNREACHABLE_RECHECK_S = 10.0


@dataclass(frozen=True)
class PodAdapters:
    """A ready serving pod and what it serves (observed through ``GET /v1/models``).

    Fields:
        name / ip: the pod.
        adapters: adapter name -> the folder it was loaded from; None when the pod did not answer.
        error: why it did not answer.
    """

    name: str
    ip: str
    adapters: Mapping[str, str] | None = None
    error: str = ""


@dataclass(frozen=True)
class LoRAOp:
    """One call to a pod: ``op`` ``load`` (``path``: relative to the pod's --lora-dir) or ``unload``."""

    pod: str
    ip: str
    op: str
    name: str
    path: str = ""


@dataclass(frozen=True)
class LoRAResult:
    """A pod's answer to a ``LoRAOp``: HTTP ``status`` (0: no answer), the runtime's
    ``reason`` (``RankTooLarge``, ``ShapeMismatch``, ``NotFound``...) and message."""

    op: LoRAOp
    status: int
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class AdapterPlan:
    """The adapters' part of a plan.

    Fields:
        apply: fetch Jobs to create and the adapter list ConfigMap.
        delete: names of fetch Jobs no longer wanted.
        ops: load/unload calls to make.
        status: ``status.adapters``; pods: ``status.pods`` (None: LoRA off).
        problem: the ``AdapterFailed`` problem, or None.
        recheck: seconds until a retry is due (a refused load, a pod that did not answer).
    """

    apply: tuple[Obj, ...] = ()
    delete: tuple[str, ...] = ()
    ops: tuple[LoRAOp, ...] = ()
    status: list[Obj] | None = None
    pods: list[Obj] | None = None
    problem: Problem | None = None
    recheck: float | None = None


def adapter_path(key: str) -> str:
    """The adapter folder of ``key`` on the claim as the pods and Jobs mount it."""
    return f"{c.DEFAULT_CACHE_ROOT}/{ADAPTERS_SUBPATH}/{key}"


def adapter_selector(owner: Mapping[str, Any]) -> str:
    """Label selector of the fetch Jobs (and their pods) of one InferenceEngine."""
    return f"{c.LABEL_ENGINE}={b.label_value(owner['name'])},{c.LABEL_COMPONENT}={COMPONENT_ADAPTER}"


def adapter_job_name(owner: Mapping[str, Any], key: str) -> str:
    return b.child_name(f"{b.deployment_name(owner)}-adapter", key[:12])


def fetch_args(a: AdapterSpec, engine_hash: str, max_rank: int) -> list[str]:
    """``kiln adapter fetch``'s arguments for adapter ``a`` (the real parser reads them:
    tests/operator/test_adapters.py)."""
    source = f"{SOURCE_MOUNT}/{a.pvc_path}" if a.pvc_claim else a.source
    args = ["adapter", "fetch", "--source", source, "--output", adapter_path(a.key),
            "--engine", engine_dir(c.DEFAULT_CACHE_ROOT, engine_hash), "--max-lora-rank", str(max_rank),
            "--termination-log", c.TERMINATION_LOG]
    if a.hf_repo:
        args += ["--download-dir", f"{c.DEFAULT_CACHE_ROOT}/{b.HF_CACHE_SUBPATH}"]
    return args


def adapter_job(spec: InferenceEngineSpec, owner: Mapping[str, Any], a: AdapterSpec, engine_hash: str,
                default_image: str = c.DEFAULT_RUNTIME_IMAGE) -> Obj:
    """The Job that fetches adapter ``a`` onto the engine cache claim (no GPU; retries and
    deadline as the build's, ``spec.build``)."""
    mounts = [{"name": "engines", "mountPath": c.DEFAULT_CACHE_ROOT}, {"name": "tmp", "mountPath": c.TMP_MOUNT}]
    volumes: list[Obj] = [{"name": "engines", "persistentVolumeClaim": {"claimName": spec.storage.claim_name}},
                          {"name": "tmp", "emptyDir": {}}]
    env: list[Obj] = [{"name": "HOME", "value": c.TMP_MOUNT}]
    if a.pvc_claim:
        mounts.append({"name": "source", "mountPath": SOURCE_MOUNT, "readOnly": True})
        volumes.append({"name": "source", "persistentVolumeClaim": {"claimName": a.pvc_claim, "readOnly": True}})
    if a.hf_token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": a.hf_token.name, "key": a.hf_token.key}}})
    if a.hf_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": a.hf_endpoint})
    container: Obj = {
        "name": c.CONTAINER_NAME, "image": spec.image or default_image, "imagePullPolicy": spec.image_pull_policy,
        "command": ["kiln"], "args": fetch_args(a, engine_hash, spec.runtime.lora.max_lora_rank), "env": env,
        "volumeMounts": mounts, "securityContext": b._container_security(),
        "terminationMessagePath": c.TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    res = b._resources(ComputeResources(spec.build.resources.requests, spec.build.resources.limits), 0, "")
    if res:
        container["resources"] = res
    labels = {**b.labels(owner, COMPONENT_ADAPTER), LABEL_ADAPTER_KEY: a.key}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": adapter_job_name(owner, a.key), "namespace": owner["namespace"], "labels": labels,
                         "ownerReferences": [b.owner_reference(owner)]},
            "spec": {"backoffLimit": spec.build.backoff_limit, "activeDeadlineSeconds": spec.build.active_deadline_seconds,
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"restartPolicy": "Never", "securityContext": b._pod_security(),
                                           "containers": [container], "volumes": volumes,
                                           "enableServiceLinks": False, **b._pod_placement(spec)}}}}


def adapter_list(owner: Mapping[str, Any], fetched: Mapping[str, str]) -> Obj:
    """The ConfigMap the pods load at start: ``adapters.json`` = ``{name: key}`` (keys are
    folders under the pods' --lora-dir)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": b.adapter_list_name(owner), "namespace": owner["namespace"],
                         "labels": b.labels(owner, c.COMPONENT_SERVER), "ownerReferences": [b.owner_reference(owner)]},
            "data": {ADAPTER_LIST_FILE: json.dumps(dict(sorted(fetched.items())), sort_keys=True)}}


def _job_key(job: Mapping[str, Any]) -> str:
    return ((job.get("metadata") or {}).get("labels") or {}).get(LABEL_ADAPTER_KEY, "")


_FETCH_ERROR = re.compile(r"kiln adapter: error: ([A-Za-z]+): (.*)", re.S)


def _job_failure(job: Mapping[str, Any], pods: tuple[Mapping[str, Any], ...]) -> tuple[str, str]:
    """``(reason, message)`` of a failed fetch Job: ``kiln adapter fetch``'s termination line
    (``kiln adapter: error: REASON: message``) when a pod left one, else the Job's condition."""
    mine = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get("job-name")
            == job["metadata"]["name"]]
    cause = diagnose.failed_build_cause(mine).strip()
    m = _FETCH_ERROR.search(cause)
    if m:
        return m.group(1), m.group(2).strip()
    _, reason, message = job_state(job)
    return "FetchFailed", "; ".join(x for x in (f"{reason}: {message}".strip(": "), cause) if x)


def plan_adapters(spec: InferenceEngineSpec, owner: Mapping[str, Any], jobs: tuple[Mapping[str, Any], ...],
                  job_pods: tuple[Mapping[str, Any], ...], pods: tuple[PodAdapters, ...],
                  results: tuple[LoRAResult, ...], built: bool, engine_hash: str, default_image: str) -> AdapterPlan:
    """The adapters' plan (see the module doc).  ``jobs``/``job_pods``: this resource's fetch
    Jobs and their pods; ``pods``: the ready serving pods as they answered; ``results``: the
    answers to this reconcile's calls (a re-plan after the act; empty before)."""
    if not spec.runtime.lora.enabled:
        return AdapterPlan(delete=tuple(j["metadata"]["name"] for j in jobs
                                        if not j["metadata"].get("deletionTimestamp")))
    by_key = {_job_key(j): j for j in jobs}
    wanted = {a.key for a in spec.adapters}
    delete = tuple(j["metadata"]["name"] for j in jobs
                   if _job_key(j) not in wanted and not j["metadata"].get("deletionTimestamp"))
    apply: list[Obj] = []
    fetched: dict[str, str] = {}
    failed: dict[str, tuple[str, str]] = {}  # name -> (reason, message)
    states: dict[str, str] = {}
    for a in spec.adapters:
        job = by_key.get(a.key)
        state = job_state(job)[0] if job else "Pending"
        if job is None and built and not spec.suspend:
            apply.append(adapter_job(spec, owner, a, engine_hash, default_image))
        if state == "Succeeded":
            fetched[a.name] = a.key
        elif state == "Failed":
            failed[a.name] = _job_failure(job, job_pods)
        states[a.name] = {"Succeeded": "Fetched", "Failed": "Failed"}.get(state, "Fetching" if built else "Pending")
    apply.append(adapter_list(owner, fetched))

    refused = {(r.op.pod, r.op.name): r for r in results if r.status != 200 and r.op.op == "load"}
    done = {(r.op.pod, r.op.op, r.op.name) for r in results if r.status == 200}
    ops: list[LoRAOp] = []
    serving: dict[str, list[str]] = {}  # pod -> adapters it serves after this plan's calls
    status_pods: list[Obj] = []
    recheck = None
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.adapters is None:
            status_pods.append({"name": pod.name, "message": pod.error or "did not answer"})
            recheck = UNREACHABLE_RECHECK_S
            continue
        have = dict(pod.adapters)
        for name, path in sorted(have.items()):
            if fetched.get(name) != PurePosixPath(path).name:  # not listed, or another source now
                have.pop(name)  # an unload fails only for a name the pod does not serve
                ops.append(LoRAOp(pod.name, pod.ip, "unload", name))
        for name, key in sorted(fetched.items()):
            if name in have:
                continue
            ops.append(LoRAOp(pod.name, pod.ip, "load", name, key))
            if (pod.name, "load", name) in done:
                have[name] = key
            elif (pod.name, name) in refused:
                r = refused[(pod.name, name)]
                failed.setdefault(name, (r.reason or f"HTTP{r.status}", f"pod {pod.name}: {r.message}"))
                recheck = FAILED_RECHECK_S
        serving[pod.name] = sorted(have)
        status_pods.append({"name": pod.name, "adapters": sorted(have)})

    status: list[Obj] = []
    for a in spec.adapters:
        n = sum(1 for names in serving.values() if a.name in names)
        st: Obj = {"name": a.name, "source": a.source, "state": states[a.name], "pods": n}
        if a.name in failed:
            st["state"] = "Failed"
            st["reason"], st["message"] = failed[a.name]
        elif a.name in fetched and serving:
            st["state"] = "Loaded" if n == len(serving) else "Loading"
        status.append(st)
    problem = None
    bad = [s for s in status if s["state"] == "Failed"]
    if bad:
        problem = Problem("AdapterFailed", "; ".join(f"adapter {s['name']}: {s['reason']}: {s['message']}"
                                                     for s in bad))
    return AdapterPlan(apply=tuple(apply), delete=delete, ops=tuple(ops), status=status, pods=status_pods,
                       problem=problem, recheck=recheck)


__all__ = ["AdapterPlan", "LoRAOp", "LoRAResult", "PodAdapters", "adapter_job", "adapter_list", "adapter_path",
           "adapter_selector", "fetch_args", "plan_adapters", "COMPONENT_ADAPTER", "LABEL_ADAPTER_KEY"]
