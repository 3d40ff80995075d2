"""``spec.pod``: the pod-spec overrides of the serving pods (and, where they make sense, of the
build pods), parsed and applied.

What platform teams set on every workload, as NIM Operator's and KServe's specs take it:
affinity and anti-affinity, topology spread, a priority class, a runtime class, image pull
secrets, pod annotations and labels (and, in ``spec.runtime``, extra ``env`` with ``valueFrom``
and ``envFrom``).  ``parse_pod`` reads the section (the CRD validated its shape; the parser
checks what the CRD cannot, e.g. labels that would collide with Kiln's own); ``apply_serving``
and ``apply_build`` put it into a pod template.

The build pod gets affinity, the priority and runtime classes, the pull secrets, annotations and
labels; not the topology spread constraints (one pod, nothing to spread) nor the serving
container's environment.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from kiln.common.enginespec import EngineSpecError

from . import constants as c
from .specfields import _str, _strings

__all__ = ["EnvVar", "parse_env", "PodOverrides", "parse_pod", "apply_serving", "apply_build", "RESERVED_LABELS"]

# Labels Kiln sets itself (selectors, engine hash, cache claim): a user's pod label may not
# replace them (a changed selector label would orphan the pods).
RESERVED_LABELS = (c.LABEL_NAME, c.LABEL_INSTANCE, c.LABEL_COMPONENT, c.LABEL_MANAGED_BY, c.LABEL_PART_OF,
                   c.LABEL_ENGINE, c.LABEL_ENGINE_HASH, c.LABEL_CACHE_CLAIM)


@dataclass(frozen=True)
class PodOverrides:
    """``spec.pod``.

    Fields:
        annotations / labels: added to the pod template's metadata (serving and build pods).
        affinity: a Pod ``affinity`` (node affinity, pod affinity and anti-affinity), or None.
        topology_spread_constraints: Pod ``topologySpreadConstraints`` of the serving pods; one
            without a ``labelSelector`` spreads this resource's serving pods (their selector).
        priority_class_name / runtime_class_name: the PriorityClass and RuntimeClass, or None.
        image_pull_secrets: names of Secrets for pulling the runtime image.
    """

    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    affinity: Mapping[str, Any] | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    image_pull_secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class EnvVar:
    """One environment variable of the serving container: a plain ``value``, or ``value_from``
    (a Pod ``valueFrom``: secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""

    name: str
    value: str = ""
    value_from: Mapping[str, Any] | None = None

    def to_pod(self) -> dict:
        """The Pod ``env`` entry."""
        if self.value_from is not None:
            return {"name": self.name, "valueFrom": dict(self.value_from)}
        return {"name": self.name, "value": self.value}


def parse_env(rt: Mapping[str, Any]) -> tuple[tuple[EnvVar, ...], tuple[dict, ...]]:
    """``runtime.env`` and ``runtime.envFrom`` of a ``spec.runtime`` dict.  Raises
    ``EngineSpecError`` naming the field."""
    env = []
    raw_env = rt.get("env") or []
    if not isinstance(raw_env, (list, tuple)):
        raise EngineSpecError(f"runtime.env: expected a list, got {type(raw_env).__name__}")
    for i, e in enumerate(raw_env):
        if not isinstance(e, Mapping) or not e.get("name"):
            raise EngineSpecError(f"runtime.env[{i}]: expected an object with a name")
        if "value" in e and "valueFrom" in e:
            raise EngineSpecError(f"runtime.env[{i}]: set value or valueFrom, not both")
        vf = e.get("valueFrom")
        if vf is not None and (not isinstance(vf, Mapping) or len(vf) != 1):
            raise EngineSpecError(f"runtime.env[{i}].valueFrom: expected exactly one source")
        env.append(EnvVar(str(e["name"]), str(e.get("value", "")), copy.deepcopy(dict(vf)) if vf is not None else None))
    env_from = rt.get("envFrom") or []
    if not isinstance(env_from, (list, tuple)):
        raise EngineSpecError(f"runtime.envFrom: expected a list, got {type(env_from).__name__}")
    for i, e in enumerate(env_from):
        if not isinstance(e, Mapping) or not (e.get("configMapRef") or e.get("secretRef")):
            raise EngineSpecError(f"runtime.envFrom[{i}]: expected a configMapRef or a secretRef")
    return tuple(env), tuple(copy.deepcopy(dict(e)) for e in env_from)


def parse_pod(raw: Mapping[str, Any]) -> PodOverrides:
    """Parse ``spec.pod`` of a spec dict.  Raises ``EngineSpecError`` naming the field."""
    pod = raw.get("pod")
    if pod is None:
        return PodOverrides()
    if not isinstance(pod, Mapping):
        raise EngineSpecError(f"pod: expected an object, got {type(pod).__name__}")
    labels = _strings(pod, "labels", "pod.labels")
    taken = sorted(set(labels) & set(RESERVED_LABELS))
    if taken:
        raise EngineSpecError(f"pod.labels: {', '.join(taken)} is set by Kiln (selectors and engine hash); "
                              "use another key")
    affinity = pod.get("affinity")
    if affinity is not None and not isinstance(affinity, Mapping):
        raise EngineSpecError(f"pod.affinity: expected an object, got {type(affinity).__name__}")
    spread = pod.get("topologySpreadConstraints") or []
    if not isinstance(spread, (list, tuple)) or not all(isinstance(x, Mapping) for x in spread):
        raise EngineSpecError("pod.topologySpreadConstraints: expected a list of objects")
    secrets = []
    for i, s in enumerate(pod.get("imagePullSecrets") or []):
        name = s.get("name") if isinstance(s, Mapping) else None
        if not isinstance(name, str) or not name:
            raise EngineSpecError(f"pod.imagePullSecrets[{i}]: expected an object with a name")
        secrets.append(name)
    return PodOverrides(
        annotations=_strings(pod, "annotations", "pod.annotations"), labels=labels,
        affinity=copy.deepcopy(dict(affinity)) if affinity else None,
        topology_spread_constraints=tuple(copy.deepcopy(dict(x)) for x in spread),
        priority_class_name=_str(pod, "priorityClassName", "pod.priorityClassName"),
        runtime_class_name=_str(pod, "runtimeClassName", "pod.runtimeClassName"),
        image_pull_secrets=tuple(secrets))


def _common(pod: PodOverrides, template: dict) -> None:
    """What serving and build pods both get: metadata, affinity, classes, pull secrets."""
    meta, spec = template["metadata"], template["spec"]
    if pod.labels:
        meta["labels"] = {**pod.labels, **meta.get("labels", {})}  # Kiln's own labels win (parse_pod refuses clashes)
    if pod.annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **pod.annotations}
    if pod.affinity:
        spec["affinity"] = copy.deepcopy(dict(pod.affinity))
    if pod.priority_class_name:
        spec["priorityClassName"] = pod.priority_class_name
    if pod.runtime_class_name:
        spec["runtimeClassName"] = pod.runtime_class_name
    if pod.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in pod.image_pull_secrets]


def apply_serving(pod: PodOverrides, template: dict, selector: Mapping[str, str]) -> dict:
    """Apply ``pod`` to the serving pod ``template`` (``{"metadata", "spec"}``, changed in place
    and returned).  A spread constraint without a ``labelSelector`` gets ``selector`` (the
    serving pods of this resource)."""
    _common(pod, template)
    if pod.topology_spread_constraints:
        spread = []
        for x in pod.topology_spread_constraints:
            x = copy.deepcopy(dict(x))
            x.setdefault("labelSelector", {"matchLabels": dict(selector)})
            spread.append(x)
        template["spec"]["topologySpreadConstraints"] = spread
    return template


def apply_build(pod: PodOverrides, template: dict) -> dict:
    """Apply ``pod`` to the build pod ``template`` (in place; returned)."""
    _common(pod, template)
    return template
