"""Pure manifest builders: ``(spec, hash, owner) -> dict``.

No I/O and no clock: every function returns the full desired state of one child as a plain
dict for server-side apply, so the same inputs always give the same manifest (applying twice
changes nothing) and each builder is unit-tested without a cluster.  ``owner`` is the
InferenceEngine's metadata slice ``{"name", "namespace", "uid"}``.
"""

from __future__ import annotations

import hashlib
import math
from decimal import Decimal
from typing import Any, Mapping

from kiln.common.enginespec import BuildSpec, engine_dir

from . import constants as c

Obj = dict[str, Any]

MAX_NAME = 63  # DNS label: Job, Service and label values


def child_name(base: str, suffix: str = "", limit: int = MAX_NAME) -> str:
    """``base-suffix`` cut to ``limit`` chars; a cut name gets 6 hex chars of sha256 of the
    full name so distinct long names stay distinct."""
    full = f"{base}-{suffix}" if suffix else base
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:6]
    keep = limit - len(digest) - 1 - (len(suffix) + 1 if suffix else 0)
    head = base[:max(keep, 1)].rstrip("-.")
    return f"{head}-{digest}-{suffix}" if suffix else f"{head}-{digest}"


def owner_reference(owner: Mapping[str, Any]) -> Obj:
    """The controller owner reference to an InferenceEngine (children are garbage-collected
    with it; ``blockOwnerDeletion`` keeps foreground deletion ordered)."""
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": owner["name"],
            "uid": owner["uid"], "controller": True, "blockOwnerDeletion": True}


def labels(owner: Mapping[str, Any], component: str, hash_: str | None = None) -> dict[str, str]:
    """Standard labels of a child of ``owner``."""
    out = {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: owner["name"][:63],
           c.LABEL_COMPONENT: component, c.LABEL_MANAGED_BY: c.MANAGED_BY,
           c.LABEL_PART_OF: "kiln", c.LABEL_ENGINE: owner["name"][:63]}
    if hash_:
        out[c.LABEL_ENGINE_HASH] = hash_
    return out


def selector_labels(owner: Mapping[str, Any]) -> dict[str, str]:
    """Immutable selector of the serving pods."""
    return {c.LABEL_ENGINE: owner["name"][:63], c.LABEL_COMPONENT: c.COMPONENT_SERVER}


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
    """Name of the serving Deployment (also the Service and the HPA)."""
    return child_name(owner["name"])


def job_name(owner: Mapping[str, Any], hash_: str) -> str:
    """Name of the build Job for ``hash_``: deterministic, so a restarted operator finds the
    Job it created instead of creating a duplicate."""
    return child_name(owner["name"], f"build-{hash_[:10]}")


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


# --- spec helpers ----------------------------------------------------------------------------

def storage(spec: Mapping[str, Any]) -> Obj:
    """``spec.storage`` with defaults filled (the API server fills them too)."""
    s = dict(spec.get("storage") or {})
    s.setdefault("claimName", "kiln-engine-cache")
    s.setdefault("create", True)
    s.setdefault("size", "50Gi")
    s.setdefault("accessModes", ["ReadWriteOnce"])
    return s


def compile_cache(spec: Mapping[str, Any]) -> bool:
    """``spec.runtime.compileCache`` (default true): the serving pods keep Triton's kernel
    cache on the engine cache claim (``kiln.runtime.compile_cache``).  Off for a claim that can
    only be mounted read-only (``accessModes: [ReadOnlyMany]``)."""
    modes = set(storage(spec).get("accessModes") or [])
    if modes and modes <= {"ReadOnlyMany"}:
        return False
    return bool((spec.get("runtime") or {}).get("compileCache", True))


def autoscaling(spec: Mapping[str, Any]) -> Obj:
    """``spec.autoscaling`` with defaults filled."""
    a = dict(spec.get("autoscaling") or {})
    a.setdefault("mode", "off")
    a.setdefault("minReplicas", 1)
    a.setdefault("maxReplicas", max(4, a["minReplicas"]))
    a.setdefault("targetQueueTimeSeconds", 0.5)
    a.setdefault("scaleUpStabilizationSeconds", 0)
    a.setdefault("scaleDownStabilizationSeconds", 300)
    return a


def _pod_placement(spec: Mapping[str, Any]) -> Obj:
    res = spec.get("resources") or {}
    out: Obj = {}
    if res.get("nodeSelector"):
        out["nodeSelector"] = dict(res["nodeSelector"])
    if res.get("tolerations"):
        out["tolerations"] = [dict(t) for t in res["tolerations"]]
    return out


def _pod_security() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def _resources(base: Mapping[str, Any] | None, gpus: int, gpu_name: str) -> Obj:
    base = base or {}
    requests = {k: str(v) for k, v in (base.get("requests") or {}).items()}
    limits = {k: str(v) for k, v in (base.get("limits") or {}).items()}
    if gpus > 0:
        requests[gpu_name] = str(gpus)
        limits[gpu_name] = str(gpus)
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _image(spec: Mapping[str, Any], default_image: str) -> str:
    return spec.get("image") or default_image


# --- children --------------------------------------------------------------------------------

def cache_claim(spec: Mapping[str, Any], owner: Mapping[str, Any]) -> Obj:
    """The engine cache PersistentVolumeClaim.  Deliberately not owned by the
    InferenceEngine: engines outlive the resource and are shared across a namespace."""
    s = storage(spec)
    pvc_spec: Obj = {"accessModes": list(s["accessModes"]),
                     "resources": {"requests": {"storage": str(s["size"])}}}
    if s.get("storageClassName"):
        pvc_spec["storageClassName"] = s["storageClassName"]
    meta = _meta(owner, s["claimName"], c.COMPONENT_CACHE, owned=False)
    meta["labels"].pop(c.LABEL_ENGINE)
    meta["labels"].pop(c.LABEL_INSTANCE)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": pvc_spec}


def engine_record(spec: Mapping[str, Any], hash_: str, owner: Mapping[str, Any], job: str,
                  completed_at: str) -> Obj:
    """The engine record: a ConfigMap saying that engine ``hash_`` is complete on the cache
    claim (written when its build Job succeeds).  Not owned: it lives as long as the claim's
    content.  Delete it to force a rebuild."""
    bs = BuildSpec.from_dict(spec)
    claim = storage(spec)["claimName"]
    from kiln.common.enginespec import canonical_json
    meta = _meta(owner, record_name(claim, hash_), c.COMPONENT_RECORD, hash_, owned=False)
    meta["labels"].pop(c.LABEL_ENGINE)
    meta["labels"].pop(c.LABEL_INSTANCE)
    meta["labels"][c.LABEL_CACHE_CLAIM] = claim[:63]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {"engineHash": hash_, "claimName": claim, "path": engine_dir(c.DEFAULT_CACHE_ROOT, hash_),
                     "buildSpec": canonical_json(bs.to_dict()), "builtBy": f"{owner['namespace']}/{job}",
                     "completedAt": completed_at}}


def build_job(spec: Mapping[str, Any], hash_: str, owner: Mapping[str, Any],
              default_image: str = c.DEFAULT_RUNTIME_IMAGE) -> Obj:
    """The build Job: ``kiln build`` writing ``/engines/<hash>`` on the cache claim.  GPUs only
    when the build calibrates; ``backoffLimit`` and ``activeDeadlineSeconds`` from
    ``spec.build``.  Raises ``EngineSpecError`` for an invalid build spec."""
    bs = BuildSpec.from_dict(spec)
    build = spec.get("build") or {}
    res = spec.get("resources") or {}
    model = spec.get("model") or {}
    gpus = int(res.get("gpus", 1)) if bs.calibrates else 0
    args = bs.to_build_args(engine_dir(c.DEFAULT_CACHE_ROOT, hash_), models_mount=c.MODELS_MOUNT)
    mounts = [{"name": "engines", "mountPath": c.DEFAULT_CACHE_ROOT},
              {"name": "tmp", "mountPath": c.TMP_MOUNT}]
    volumes: list[Obj] = [
        {"name": "engines", "persistentVolumeClaim": {"claimName": storage(spec)["claimName"]}},
        {"name": "tmp", "emptyDir": {}},
    ]
    env: list[Obj] = [{"name": "HOME", "value": c.TMP_MOUNT},
                      {"name": "KILN_ENGINE_HASH", "value": hash_},
                      # kiln build creates the serving pods' shared compile cache folder (as the
                      # pods' user: a folder the kubelet makes for a subPath would be root's)
                      {"name": "KILN_COMPILE_CACHE_DIR",
                       "value": f"{c.DEFAULT_CACHE_ROOT}/{c.COMPILE_CACHE_SUBPATH}"}]
    if model.get("pvc"):
        mounts.append({"name": "model", "mountPath": c.MODELS_MOUNT, "readOnly": True})
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": model["pvc"]["claimName"], "readOnly": True}})
    hf = model.get("huggingFace") or {}
    if hf.get("secretRef"):
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": hf["secretRef"]["name"], "key": hf["secretRef"].get("key", "token")}}})
    container: Obj = {
        "name": c.CONTAINER_NAME, "image": _image(spec, default_image),
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        "command": ["kiln", "build"], "args": args, "env": env, "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    resources = _resources(build.get("resources"), gpus, res.get("gpuResourceName", "nvidia.com/gpu"))
    if resources:
        container["resources"] = resources
    pod_labels = labels(owner, c.COMPONENT_BUILD, hash_)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _meta(owner, job_name(owner, hash_), c.COMPONENT_BUILD, hash_),
        "spec": {
            "backoffLimit": int(build.get("backoffLimit", 1)),
            "activeDeadlineSeconds": int(build.get("activeDeadlineSeconds", 7200)),
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {"restartPolicy": "Never", "securityContext": _pod_security(),
                         "containers": [container], "volumes": volumes,
                         "enableServiceLinks": False, **_pod_placement(spec)},
            },
        },
    }


def serve_args(spec: Mapping[str, Any], hash_: str, owner: Mapping[str, Any]) -> list[str]:
    """The ``kiln serve`` arguments for engine ``hash_``."""
    rt = spec.get("runtime") or {}
    model = spec.get("model") or {}
    args = ["--engine", engine_dir(c.DEFAULT_CACHE_ROOT, hash_), "--host", "0.0.0.0",
            "--port", str(c.HTTP_PORT),
            "--served-model-name", model.get("servedModelName") or owner["name"]]
    flags = (("maxNumSeqs", "--max-num-seqs"), ("maxNumBatchedTokens", "--max-num-batched-tokens"),
             ("maxModelLen", "--max-model-len"), ("blockSize", "--block-size"),
             ("kvCacheMemoryFraction", "--kv-cache-memory-fraction"),
             ("schedulerPolicy", "--scheduler-policy"))
    for key, flag in flags:
        if rt.get(key) is not None:
            args += [flag, str(rt[key])]
    gpus = int((spec.get("resources") or {}).get("gpus", 1))
    args += ["--device", "cuda" if gpus > 0 else "cpu"]
    if int(rt.get("tensorParallelSize", 1)) > 1:
        args += ["--tensor-parallel-size", str(rt["tensorParallelSize"])]
    args += [str(a) for a in rt.get("extraArgs") or []]
    return args


def deployment(spec: Mapping[str, Any], hash_: str, owner: Mapping[str, Any], *,
               replicas: int | None, default_image: str = c.DEFAULT_RUNTIME_IMAGE) -> Obj:
    """The serving Deployment running ``kiln serve --engine /engines/<hash>``.

    ``replicas=None`` leaves ``spec.replicas`` out so an HPA owns it.  The engine hash is a
    pod-template label, so a new engine rolls the pods and an unchanged spec never does.
    Probes: startup and readiness on ``/ready`` (startup budget from
    ``rollout.startupTimeoutSeconds``), liveness on ``/health``.  The engine claim is mounted
    read-only at ``/engines``; with ``runtime.compileCache`` (default) its ``.compile-cache``
    folder is also mounted read-write as ``TRITON_CACHE_DIR``'s parent.
    """
    rt = spec.get("runtime") or {}
    res = spec.get("resources") or {}
    rollout = spec.get("rollout") or {}
    gpus = int(res.get("gpus", 1))
    tp = int(rt.get("tensorParallelSize", 1))
    startup_budget = int(rollout.get("startupTimeoutSeconds", 1800))
    period = 10
    env = [{"name": "HOME", "value": c.TMP_MOUNT}, {"name": "KILN_ENGINE_HASH", "value": hash_}]
    user_env = [{"name": e["name"], "value": str(e.get("value", ""))} for e in rt.get("env") or []]
    mounts: list[Obj] = [{"name": "engines", "mountPath": c.DEFAULT_CACHE_ROOT, "readOnly": True},
                         {"name": "tmp", "mountPath": c.TMP_MOUNT},
                         {"name": "dshm", "mountPath": "/dev/shm"}]
    cache = compile_cache(spec)
    if cache:
        # Triton's kernel cache on the claim: later pods (rollouts, scale-ups) skip the compiles
        mounts.append({"name": "engines", "mountPath": c.COMPILE_CACHE_MOUNT, "subPath": c.COMPILE_CACHE_SUBPATH})
        if not any(e["name"] == "TRITON_CACHE_DIR" for e in user_env):
            env.append({"name": "TRITON_CACHE_DIR", "value": f"{c.COMPILE_CACHE_MOUNT}/triton"})
    env += user_env
    container: Obj = {
        "name": c.CONTAINER_NAME, "image": _image(spec, default_image),
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        "command": ["kiln", "serve"], "args": serve_args(spec, hash_, owner), "env": env,
        "ports": [{"name": "http", "containerPort": c.HTTP_PORT, "protocol": "TCP"}],
        "startupProbe": {"httpGet": {"path": c.READY_PATH, "port": "http"}, "periodSeconds": period,
                         "failureThreshold": max(1, math.ceil(startup_budget / period)),
                         "timeoutSeconds": 5},
        "readinessProbe": {"httpGet": {"path": c.READY_PATH, "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3, "timeoutSeconds": 5},
        "livenessProbe": {"httpGet": {"path": c.HEALTH_PATH, "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6, "timeoutSeconds": 5},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    resources = _resources(res, gpus * tp, res.get("gpuResourceName", "nvidia.com/gpu"))
    if resources:
        container["resources"] = resources
    pod_labels = {**labels(owner, c.COMPONENT_SERVER, hash_), **selector_labels(owner)}
    dep_spec: Obj = {
        "selector": {"matchLabels": selector_labels(owner)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": int(rollout.get("maxSurge", 1)),
            "maxUnavailable": int(rollout.get("maxUnavailable", 0))}},
        "revisionHistoryLimit": 3,
        "template": {
            "metadata": {"labels": pod_labels},
            "spec": {"securityContext": _pod_security(), "containers": [container],
                     "terminationGracePeriodSeconds": 60, "enableServiceLinks": False,
                     "volumes": [
                         {"name": "engines", "persistentVolumeClaim": {
                             "claimName": storage(spec)["claimName"],
                             # read-only unless the compile cache needs its one writable subPath
                             "readOnly": not cache}},
                         {"name": "tmp", "emptyDir": {}},
                         {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                     **_pod_placement(spec)},
        },
    }
    if replicas is not None:
        dep_spec["replicas"] = int(replicas)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER, hash_),
            "spec": dep_spec}


def service(spec: Mapping[str, Any], owner: Mapping[str, Any]) -> Obj:
    """The ClusterIP Service on port 8000 in front of the serving pods."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER),
            "spec": {"type": "ClusterIP", "selector": selector_labels(owner),
                     "ports": [{"name": "http", "port": c.HTTP_PORT, "targetPort": "http",
                                "protocol": "TCP"}]}}


def hpa(spec: Mapping[str, Any], owner: Mapping[str, Any]) -> Obj:
    """The ``autoscaling/v2`` HPA for mode ``hpa``: a Pods metric
    ``kiln_request_queue_time_seconds`` (mean queue time per pod, as prometheus-adapter's rule
    in the chart serves it) with target ``targetQueueTimeSeconds`` as an average value."""
    a = autoscaling(spec)
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(owner, deployment_name(owner), c.COMPONENT_SERVER),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": deployment_name(owner)},
            "minReplicas": int(a["minReplicas"]), "maxReplicas": int(a["maxReplicas"]),
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": c.HPA_METRIC_NAME},
                "target": {"type": "AverageValue",
                           "averageValue": to_quantity(a["targetQueueTimeSeconds"])}}}],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": int(a["scaleUpStabilizationSeconds"])},
                "scaleDown": {"stabilizationWindowSeconds": int(a["scaleDownStabilizationSeconds"])},
            },
        },
    }


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
