"""Pure manifest builders: ``(spec, hash, owner) -> dict``.

No I/O and no clock: every function returns the full desired state of one child as a plain
dict for server-side apply, so the same inputs always give the same manifest (applying twice
changes nothing) and each builder is unit-tested without a cluster.  ``spec`` is the parsed
``InferenceEngineSpec`` (a plain ``spec`` dict, as in a manifest, is parsed first);
``owner`` is the InferenceEngine's metadata slice ``{"name", "namespace", "uid"}``.
"""

from __future__ import annotations

import hashlib
import json
import math
from decimal import Decimal
from typing import Any, Mapping, Sequence, Union

from kiln.common.enginespec import CALIBRATION_MOUNT, canonical_json, engine_dir
from kiln.common.tensorparallel import ParallelShape

from . import constants as c
from .adapter_spec import ADAPTER_LIST_MOUNT, lora_serve_args
from . import podspec
from .names import MAX_NAME, child_name, dns_label, label_value  # noqa: F401  (re-exported)
from .speculative import LABEL_DRAFT_ENGINE_HASH, eagle_volumes, speculative_serve_args
from .spec import ComputeResources, InferenceEngineSpec, as_spec

Obj = dict[str, Any]
Spec = Union[InferenceEngineSpec, Mapping[str, Any]]  # parsed, or a plain spec dict (parsed here)


def owner_ref(owner: Mapping[str, Any], controller: bool = True) -> Obj:
    """An owner reference to an InferenceEngine (children are garbage-collected with it).
    The serving children have one controller reference (``blockOwnerDeletion`` keeps
    foreground deletion ordered); a shared build Job has one plain reference per resource
    that needs it, so it lives while any of them does."""
    ref: Obj = {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": owner["name"], "uid": owner["uid"]}
    if controller:
        ref.update(controller=True, blockOwnerDeletion=True)
    return ref


def owner_reference(owner: Mapping[str, Any]) -> Obj:
    """The controller owner reference to an InferenceEngine (``owner_ref``)."""
    return owner_ref(owner)


def labels(owner: Mapping[str, Any], component: str, hash_: str | None = None) -> dict[str, str]:
    """Standard labels of a child of ``owner``."""
    out = {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: label_value(owner["name"]),
           c.LABEL_COMPONENT: component, c.LABEL_MANAGED_BY: c.MANAGED_BY,
           c.LABEL_PART_OF: "kiln", c.LABEL_ENGINE: label_value(owner["name"])}
    if hash_:
        out[c.LABEL_ENGINE_HASH] = hash_
    return out


def build_labels(claim: str, hash_: str) -> dict[str, str]:
    """Labels of a build Job and its pods: shared by every resource that needs engine
    ``hash_`` on ``claim``, so no resource name appears."""
    return {c.LABEL_NAME: c.APP_NAME, c.LABEL_COMPONENT: c.COMPONENT_BUILD, c.LABEL_MANAGED_BY: c.MANAGED_BY,
            c.LABEL_PART_OF: "kiln", c.LABEL_ENGINE_HASH: hash_, c.LABEL_CACHE_CLAIM: label_value(claim)}


def build_selector(claim: str) -> str:
    """Label selector of the build Jobs (and their pods) of one cache claim."""
    return f"{c.LABEL_COMPONENT}={c.COMPONENT_BUILD},{c.LABEL_CACHE_CLAIM}={label_value(claim)}"


def gc_selector(claim: str) -> str:
    """Label selector of the engine cache cleanup Jobs of one cache claim."""
    return f"{c.LABEL_COMPONENT}={c.COMPONENT_GC},{c.LABEL_CACHE_CLAIM}={label_value(claim)}"


def selector_labels(owner: Mapping[str, Any]) -> dict[str, str]:
    """Immutable selector of the serving pods."""
    return {c.LABEL_ENGINE: label_value(owner["name"]), c.LABEL_COMPONENT: c.COMPONENT_SERVER}


def selector_string(owner: Mapping[str, Any]) -> str:
    """``selector_labels`` as a label-selector string (status.selector, the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(owner).items()))


def _meta(owner: Mapping[str, Any], name: str, component: str, hash_: str | None = None,
          owned: bool = True) -> Obj:
    meta: Obj = {"name": name, "namespace": owner["namespace"],
                 "labels": labels(owner, component, hash_)}
    if owned:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def deployment_name(owner: Mapping[str, Any]) -> str:
    """Name of the serving Deployment, the Service and the HPA: the resource's name when it
    is a valid Service name, else ``dns_label`` of it (``llama-3.1-8b`` ->
    ``llama-3-1-8b-<8 hex>``)."""
    return dns_label(owner["name"])


def job_name(claim: str, hash_: str) -> str:
    """Name of the build Job of engine ``hash_`` on cache claim ``claim``: one Job per
    (claim, engine), shared by every resource of the namespace that needs that engine, and
    deterministic, so a restarted operator finds the Job instead of creating another.  At most
    63 characters (the Job controller puts it in a pod label): a long claim name is cut and
    gets 8 hex chars of sha256 of the whole."""
    base = f"kiln-build-{hash_}"
    full = f"{base}-{claim}"
    if len(full) <= MAX_NAME:
        return full
    digest = hashlib.sha256(claim.encode()).hexdigest()[:8]
    return f"{base}-{claim[:MAX_NAME - len(base) - 10].rstrip('-.')}-{digest}"


def record_name(claim: str, hash_: str) -> str:
    """Name of the engine record ConfigMap: the engine ``hash_`` is complete on ``claim``."""
    return child_name(f"kiln-engine-{hash_}", claim[:20], limit=253)


def service_host(owner: Mapping[str, Any]) -> str:
    """In-cluster DNS name of the Service."""
    return f"{deployment_name(owner)}.{owner['namespace']}.svc"


def endpoint(owner: Mapping[str, Any]) -> str:
    """The OpenAI-compatible base URL reported in ``status.endpoint``."""
    return f"http://{service_host(owner)}:{c.HTTP_PORT}/v1"


def to_quantity(seconds: float) -> str:
    """A non-negative number of seconds as a Kubernetes quantity in milli-units (0.5 -> ``500m``)."""
    milli = int(Decimal(str(seconds)) * 1000)
    return f"{milli // 1000}" if milli % 1000 == 0 else f"{milli}m"


# --- pod parts ---------------------------------------------------------------------------------

def _pod_placement(spec: InferenceEngineSpec) -> Obj:
    res = spec.resources
    out: Obj = {}
    if res.node_selector:
        out["nodeSelector"] = dict(res.node_selector)
    if res.tolerations:
        out["tolerations"] = [dict(t) for t in res.tolerations]
    return out


def _pod_security() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def _resources(base: ComputeResources, gpus: int, gpu_name: str) -> Obj:
    requests = dict(base.requests)
    limits = dict(base.limits)
    if gpus > 0:
        requests[gpu_name] = str(gpus)
        limits[gpu_name] = str(gpus)
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _image(spec: InferenceEngineSpec, default_image: str) -> str:
    return spec.image or default_image


# --- children --------------------------------------------------------------------------------

def cache_claim(spec: Spec, owner: Mapping[str, Any]) -> Obj:
    """The engine cache PersistentVolumeClaim.  Deliberately not owned by the
    InferenceEngine: engines outlive the resource and are shared across a namespace."""
    s = as_spec(spec).storage
    pvc_spec: Obj = {"accessModes": list(s.access_modes),
                     "resources": {"requests": {"storage": s.size}}}
    if s.storage_class_name:
        pvc_spec["storageClassName"] = s.storage_class_name
    meta = _meta(owner, s.claim_name, c.COMPONENT_CACHE, owned=False)
    meta["labels"].pop(c.LABEL_ENGINE)
    meta["labels"].pop(c.LABEL_INSTANCE)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": pvc_spec}


def engine_record(spec: Spec, hash_: str, owner: Mapping[str, Any], job: str,
                  completed_at: str, report: Mapping[str, Any] | None = None) -> Obj:
    """The engine record: a ConfigMap saying that engine ``hash_`` is complete on the cache
    claim (written when its build Job succeeds).  Not owned: it lives as long as the claim's
    content.  Delete it to force a rebuild.  ``report`` is the build's own
    (``kiln.common.enginecache.parse_build_report``): the engine's size, accuracy and the
    sizes tensor parallelism splits (``shape``)."""
    spec = as_spec(spec)
    claim = spec.storage.claim_name
    meta = _meta(owner, record_name(claim, hash_), c.COMPONENT_RECORD, hash_, owned=False)
    meta["labels"].pop(c.LABEL_ENGINE)
    meta["labels"].pop(c.LABEL_INSTANCE)
    meta["labels"][c.LABEL_CACHE_CLAIM] = label_value(claim)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {"engineHash": hash_, "claimName": claim, "path": engine_dir(c.DEFAULT_CACHE_ROOT, hash_),
                     "buildSpec": canonical_json(spec.engine.to_dict()), "builtBy": f"{owner['namespace']}/{job}",
                     "completedAt": completed_at, **_report_data(report)}}


def _report_data(report: Mapping[str, Any] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if report and isinstance(report.get("bytes"), int):
        out["sizeBytes"] = str(report["bytes"])
    if report and report.get("accuracy"):
        out["accuracy"] = json.dumps(report["accuracy"], sort_keys=True, separators=(",", ":"))  # floats: not canonical_json
    shape = ParallelShape.from_dict(report.get("shape")) if report else None
    if shape is not None:
        out["shape"] = canonical_json(shape.to_dict())
    return out


HF_CACHE_SUBPATH = ".hf-cache"  # Hub downloads on the cache claim (kiln build --download-dir)


def build_job(spec: Spec, hash_: str, owners: Sequence[Mapping[str, Any]],
              default_image: str = c.DEFAULT_RUNTIME_IMAGE) -> Obj:
    """The build Job: ``kiln build`` writing ``/engines/<hash>`` on the cache claim.  GPUs only
    when the build calibrates; ``backoffLimit`` and ``activeDeadlineSeconds`` from
    ``spec.build``.  ``owners`` are the InferenceEngines that need the engine (one plain owner
    reference each: the Job is garbage-collected when the last of them is deleted); the pod
    settings come from ``spec``, the first of them."""
    spec = as_spec(spec)
    if isinstance(owners, Mapping):
        owners = [owners]
    claim = spec.storage.claim_name
    bs, model = spec.engine, spec.model
    gpus = spec.resources.gpus if bs.calibrates else 0
    args = bs.to_build_args(engine_dir(c.DEFAULT_CACHE_ROOT, hash_), models_mount=c.MODELS_MOUNT)
    args += ["--termination-log", c.TERMINATION_LOG]  # the failure's cause reaches the status
    if spec.build.accuracy_gate is not None:  # kiln eval against the source before the engine is recorded
        ppl, agree, prompts = spec.build.accuracy_gate
        args += (["--max-perplexity-increase", str(ppl)] if ppl is not None else []) \
            + (["--min-greedy-agreement", str(agree)] if agree is not None else []) + ["--gate-prompts", str(prompts)]
    mounts = [{"name": "engines", "mountPath": c.DEFAULT_CACHE_ROOT},
              {"name": "tmp", "mountPath": c.TMP_MOUNT}]
    volumes: list[Obj] = [
        {"name": "engines", "persistentVolumeClaim": {"claimName": spec.storage.claim_name}},
        {"name": "tmp", "emptyDir": {"sizeLimit": spec.build.scratch_size}},
    ]
    env: list[Obj] = [{"name": "HOME", "value": c.TMP_MOUNT},
                      {"name": "KILN_ENGINE_HASH", "value": hash_},
                      # kiln build creates the serving pods' shared compile cache folder (as the
                      # pods' user: a folder the kubelet makes for a subPath would be root's)
                      {"name": "KILN_COMPILE_CACHE_DIR",
                       "value": f"{c.DEFAULT_CACHE_ROOT}/{c.COMPILE_CACHE_SUBPATH}"}]
    if model.pvc_claim:
        mounts.append({"name": "model", "mountPath": c.MODELS_MOUNT, "readOnly": True})
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": model.pvc_claim, "readOnly": True}})
    if bs.calibrates and bs.calibration is not None and bs.calibration.kind == "pvc":  # build.calibration
        mounts.append({"name": "calibration", "mountPath": CALIBRATION_MOUNT, "readOnly": True})
        volumes.append({"name": "calibration", "persistentVolumeClaim": {
            "claimName": bs.calibration.claim_name, "readOnly": True}})
    hub_data = bs.calibrates and bs.calibration is not None and bs.calibration.kind == "huggingFace"
    # one HF_TOKEN / HF_ENDPOINT for the model and a calibration dataset (spec.py refuses two)
    token = model.hf_token or (spec.build.calibration_hf_token if hub_data else None)
    endpoint = model.hf_endpoint or (spec.build.calibration_hf_endpoint if hub_data else None)
    if token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    if endpoint:
        env.append({"name": "HF_ENDPOINT", "value": endpoint})
    if model.hf_repo or hub_data:  # the download cache on the claim: another build of the model downloads nothing
        args += ["--download-dir", f"{c.DEFAULT_CACHE_ROOT}/{HF_CACHE_SUBPATH}"]
    container: Obj = {
        "name": c.CONTAINER_NAME, "image": _image(spec, default_image),
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kiln", *bs.command], "args": args, "env": env, "volumeMounts": mounts,
        "securityContext": _container_security(),
        "terminationMessagePath": c.TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    requests = dict(spec.build.resources.requests)
    requests.setdefault("ephemeral-storage", spec.build.scratch_size)  # the download folder
    resources = _resources(ComputeResources(requests, spec.build.resources.limits), gpus,
                           spec.resources.gpu_resource_name)
    if resources:
        container["resources"] = resources
    pod_labels = build_labels(claim, hash_)
    meta = {"name": job_name(claim, hash_), "namespace": owners[0]["namespace"], "labels": dict(pod_labels),
            "ownerReferences": build_owner_refs(owners)}
    template = podspec.apply_build(spec.pod, {
        "metadata": {"labels": pod_labels},
        "spec": {"restartPolicy": "Never", "securityContext": _pod_security(),
                 "containers": [container], "volumes": volumes,
                 "enableServiceLinks": False, **_pod_placement(spec)}})
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": spec.build.backoff_limit,
            "activeDeadlineSeconds": spec.build.active_deadline_seconds,
            # bad input (2) and a failed accuracy gate (3) fail the same way again: no retry
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": c.CONTAINER_NAME, "operator": "In", "values": [2, 3]}}]},
            "template": template,
        },
    }


def build_owner_refs(owners: Sequence[Mapping[str, Any]]) -> list[Obj]:
    """The owner references of a shared build Job: one plain reference per resource, sorted."""
    return [owner_ref(o, controller=False) for o in sorted(owners, key=lambda o: o["uid"])]


def serve_args(spec: Spec, hash_: str, owner: Mapping[str, Any]) -> list[str]:
    """The ``kiln serve`` arguments for engine ``hash_``."""
    spec = as_spec(spec)
    rt = spec.runtime
    args = ["--engine", engine_dir(c.DEFAULT_CACHE_ROOT, hash_), "--host", "0.0.0.0",
            "--port", str(c.HTTP_PORT),
            "--served-model-name", spec.model.served_model_name or owner["name"]]
    flags = ((rt.max_num_seqs, "--max-num-seqs"), (rt.max_num_batched_tokens, "--max-num-batched-tokens"),
             (rt.max_model_len, "--max-model-len"), (rt.block_size, "--block-size"),
             (rt.kv_cache_memory_fraction, "--kv-cache-memory-fraction"),
             (rt.scheduler_policy, "--scheduler-policy"))
    for value, flag in flags:
        if value is not None:
            args += [flag, str(value)]
    args += ["--device", "cuda" if spec.resources.gpus > 0 else "cpu"]
    if rt.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(rt.tensor_parallel_size)]
    args += lora_serve_args(rt.lora, c.DEFAULT_CACHE_ROOT)
    args += speculative_serve_args(rt.speculative, spec.storage.claim_name)
    args += list(rt.extra_args)
    return args


def adapter_list_name(owner: Mapping[str, Any]) -> str:
    """Name of the ConfigMap listing the adapters a serving pod loads at start."""
    return child_name(deployment_name(owner), "adapters")


def _serve_container(spec: InferenceEngineSpec, hash_: str, owner: Mapping[str, Any],
                     default_image: str) -> Obj:
    """The serving container: ``kiln serve``, its probes, mounts, environment and GPUs."""
    rt, res = spec.runtime, spec.resources
    period = 10
    env = [{"name": "HOME", "value": c.TMP_MOUNT}, {"name": "KILN_ENGINE_HASH", "value": hash_}]
    user_env = [e.to_pod() for e in rt.env]
    mounts: list[Obj] = [{"name": "engines", "mountPath": c.DEFAULT_CACHE_ROOT, "readOnly": True},
                         {"name": "tmp", "mountPath": c.TMP_MOUNT},
                         {"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.keeps_compile_cache:
        # Triton's kernel cache on the claim: later pods (rollouts, scale-ups) skip the compiles
        mounts.append({"name": "engines", "mountPath": c.COMPILE_CACHE_MOUNT, "subPath": c.COMPILE_CACHE_SUBPATH})
        if not any(e["name"] == "TRITON_CACHE_DIR" for e in user_env):
            env.append({"name": "TRITON_CACHE_DIR", "value": f"{c.COMPILE_CACHE_MOUNT}/triton"})
    env += user_env
    mounts += eagle_volumes(rt.speculative, spec.storage.claim_name)[1]  # an EAGLE head on another claim
    if rt.lora.enabled:  # the adapter list, read at start (adapters.py keeps it current)
        mounts.append({"name": "adapters", "mountPath": ADAPTER_LIST_MOUNT, "readOnly": True})
    if rt.api_key is not None:  # kiln serve reads its API key from KILN_API_KEY; probes stay open
        env.append({"name": "KILN_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": rt.api_key.name, "key": rt.api_key.key}}})
    container: Obj = {
        "name": c.CONTAINER_NAME, "image": _image(spec, default_image),
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kiln", "serve"], "args": serve_args(spec, hash_, owner), "env": env,
        **({"envFrom": [dict(e) for e in rt.env_from]} if rt.env_from else {}),
        "ports": [{"name": "http", "containerPort": c.HTTP_PORT, "protocol": "TCP"}],
        "startupProbe": {"httpGet": {"path": c.READY_PATH, "port": "http"}, "periodSeconds": period,
                         "failureThreshold": max(1, math.ceil(spec.rollout.startup_timeout_seconds / period)),
                         "timeoutSeconds": 5},
        "readinessProbe": {"httpGet": {"path": c.READY_PATH, "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3, "timeoutSeconds": 5},
        "livenessProbe": {"httpGet": {"path": c.HEALTH_PATH, "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6, "timeoutSeconds": 5},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
        "terminationMessagePath": c.TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources = _resources(res.compute, res.gpus * rt.tensor_parallel_size, res.gpu_resource_name)
    if resources:
        container["resources"] = resources
    return container


def deployment(spec: Spec, hash_: str, owner: Mapping[str, Any], *,
               replicas: int | None, default_image: str = c.DEFAULT_RUNTIME_IMAGE) -> Obj:
    """The serving Deployment running ``kiln serve --engine /engines/<hash>``.

    ``replicas=None`` leaves ``spec.replicas`` out so an HPA owns it.  The engine hash is a
    pod-template label, so a new engine rolls the pods and an unchanged spec never does.
    Probes: startup and readiness on ``/ready`` (startup budget from
    ``rollout.startupTimeoutSeconds``), liveness on ``/health``.  The engine claim is mounted
    read-only at ``/engines``; with ``runtime.compileCache`` (default) its ``.compile-cache``
    folder is also mounted read-write as ``TRITON_CACHE_DIR``'s parent.
    """
    spec = as_spec(spec)
    pod_labels = {**labels(owner, c.COMPONENT_SERVER, hash_), **selector_labels(owner)}
    if spec.draft_hash:  # the draft engine it serves with (a new draft rolls the pods; kept by the cleanup)
        pod_labels[LABEL_DRAFT_ENGINE_HASH] = spec.draft_hash
    dep_spec: Obj = {
        "selector": {"matchLabels": selector_labels(owner)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable}},
        "revisionHistoryLimit": 3,
        "template": podspec.apply_serving(spec.pod, {
            "metadata": {"labels": pod_labels},
            "spec": {"securityContext": _pod_security(),
                     "containers": [_serve_container(spec, hash_, owner, default_image)],
                     "terminationGracePeriodSeconds": 60, "enableServiceLinks": False,
                     "volumes": [
                         {"name": "engines", "persistentVolumeClaim": {
                             "claimName": spec.storage.claim_name,
                             # read-only unless the compile cache needs its one writable subPath
                             "readOnly": not spec.keeps_compile_cache}},
                         {"name": "tmp", "emptyDir": {}},
                         {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.runtime.shm_size}},
                         *([{"name": "adapters", "configMap": {"name": adapter_list_name(owner)}}]
                           if spec.runtime.lora.enabled else []),
                         *eagle_volumes(spec.runtime.speculative, spec.storage.claim_name)[0]],
                     **_pod_placement(spec)},
        }, selector_labels(owner)),
    }
    if replicas is not None:
        dep_spec["replicas"] = int(replicas)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER, hash_),
            "spec": dep_spec}


def service(spec: Spec, owner: Mapping[str, Any]) -> Obj:
    """The ClusterIP Service on port 8000 in front of the serving pods."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER),
            "spec": {"type": "ClusterIP", "selector": selector_labels(owner),
                     "ports": [{"name": "http", "port": c.HTTP_PORT, "targetPort": "http",
                                "protocol": "TCP"}]}}


def event(owner: Mapping[str, Any], *, type_: str, reason: str, message: str, now: str,
          name_suffix: str) -> Obj:
    """A core/v1 Event about the InferenceEngine (``type_`` Normal or Warning)."""
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": child_name(owner["name"], name_suffix, limit=253),
                         "namespace": owner["namespace"],
                         "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY}},
            "involvedObject": {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": owner["name"],
                               "namespace": owner["namespace"], "uid": owner["uid"]},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": c.MANAGED_BY}, "reportingComponent": c.MANAGED_BY,
            "reportingInstance": c.MANAGED_BY,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1}
