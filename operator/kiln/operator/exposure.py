"""The plan of the optional-API children: the Gateway API exposure (``spec.gateway``:
HTTPRoute, InferencePool and its endpoint picker) and KEDA's ScaledObject (autoscaling mode
``keda``).  Pure, like ``plan``: what the API server serves comes in as ``served`` (discovered
by the reconciler, never assumed).

- An asked-for kind that is served is applied; one that is not gets a condition whose reason
  says which API is missing (``GatewayAPINotInstalled``, ``InferencePoolNotInstalled``,
  ``KEDANotInstalled``) and the rest of the resource keeps reconciling: the Deployment and
  Service are applied, an HTTPRoute without a pool sends traffic to the Service, and a keda
  engine without KEDA serves ``minReplicas`` pods.
- Children no longer asked for are deleted when the last status says they were applied
  (``status.gateway``, ``status.scaledObject``), so engines that never asked make no calls.
  The endpoint picker's objects are owned by the InferencePool (so applied once its uid is
  known) and go with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from . import builders as b
from . import builders_autoscaling as ba
from . import builders_gateway as bg
from . import conditions as cond
from .spec import InferenceEngineSpec

__all__ = ["COND_EXPOSED", "COND_SCALING", "OPTIONAL_KINDS", "Exposure", "plan_exposure", "wanted_kinds"]

COND_EXPOSED = "Exposed"  # spec.gateway: the HTTPRoute / InferencePool applied
COND_SCALING = "ScalerReady"  # autoscaling mode keda: the ScaledObject applied

ROUTE = (bg.GATEWAY_API_VERSION, "HTTPRoute")
POOL = (bg.POOL_API_VERSION, "InferencePool")
SCALED = (ba.KEDA_API_VERSION, "ScaledObject")
OPTIONAL_KINDS = (ROUTE, POOL, SCALED)

Obj = dict[str, Any]


@dataclass(frozen=True)
class Exposure:
    """This part of a plan.

    Fields:
        apply: manifests to apply (after the Service).
        delete: ``(apiVersion, kind, name)`` of children to delete.
        conditions: the ``Exposed`` / ``ScalerReady`` conditions (only when asked for).
        status: ``status.gateway`` and ``status.scaledObject`` entries (only what was applied).
        keda_scales: a ScaledObject owns the Deployment's replicas.
    """

    apply: tuple[Obj, ...] = ()
    delete: tuple[tuple[str, str, str], ...] = ()
    conditions: tuple[cond.Condition, ...] = ()
    status: Mapping[str, Any] = field(default_factory=dict)
    keda_scales: bool = False


def wanted_kinds(spec: InferenceEngineSpec, status: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The optional kinds a reconcile must discover: those ``spec`` asks for, and those the last
    status says were applied (to delete them)."""
    g, gs = spec.gateway, status.get("gateway") or {}
    out = []
    if g.http_route is not None or gs.get("httpRoute"):
        out.append(ROUTE)
    if g.inference_pool is not None or gs.get("inferencePool"):
        out.append(POOL)
    if spec.autoscaling.mode == "keda" or status.get("scaledObject"):
        out.append(SCALED)
    return tuple(out)


def _missing(kind: tuple[str, str]) -> str:
    return f"the API server does not serve {kind[1]} ({kind[0]}): install its CRDs"


def plan_exposure(spec: InferenceEngineSpec, owner: Mapping[str, Any], status: Mapping[str, Any],
                  served: frozenset[tuple[str, str]], serving: bool, pool_uid: str | None = None,
                  epp_role: tuple[str, str] = bg.EPP_ROLE) -> Exposure:
    """The optional children of ``spec`` given the kinds the API server ``served``.  ``serving``:
    a serving Deployment exists after this plan's apply (the ScaledObject needs a target);
    ``pool_uid``: the InferencePool's uid (None: not created yet, its picker waits for it);
    ``epp_role``: the ``(kind, name)`` the picker's RoleBinding refers to."""
    name = b.deployment_name(owner)
    g, gs = spec.gateway, status.get("gateway") or {}
    apply: list[Obj] = []
    delete: list[tuple[str, str, str]] = []
    conds: list[cond.Condition] = []
    st: dict[str, Any] = {}
    gw: dict[str, Any] = {}
    notes: list[str] = []
    reason = ""
    pool_on = g.inference_pool is not None and POOL in served and not spec.suspend
    if g.inference_pool is not None and POOL not in served:
        reason, notes = "InferencePoolNotInstalled", [_missing(POOL)]
    if pool_on:
        apply.append(bg.inference_pool(spec, owner))
        picker = g.inference_pool.endpoint_picker
        if picker.deploy and pool_uid:
            apply += bg.endpoint_picker(spec, owner, pool_uid, epp_role)
        gw["inferencePool"] = {"name": name, "endpointPicker": bg.epp_name(owner) if picker.deploy else
                               picker.service_name}
    elif gs.get("inferencePool"):
        delete.append((*POOL, name))  # its endpoint picker goes with it (owner references)
    if g.http_route is not None and ROUTE in served:
        apply.append(bg.http_route(spec, owner, to_pool=pool_on))
        gw["httpRoute"] = {"name": name, "backend": "InferencePool" if pool_on else "Service"}
    elif g.http_route is not None:
        reason, notes = "GatewayAPINotInstalled", [_missing(ROUTE)] + notes
    elif gs.get("httpRoute"):
        delete.append((*ROUTE, name))
    if g.wanted:
        if reason:
            conds.append(cond.Condition(COND_EXPOSED, "False", reason,
                                        "; ".join(notes) + "; the Deployment and Service are reconciled as usual"))
        elif spec.suspend and g.inference_pool is not None:
            conds.append(cond.Condition(COND_EXPOSED, "False", "Suspended", "the InferencePool is removed while suspended"))
        else:
            conds.append(cond.Condition(COND_EXPOSED, "True", "Applied",
                                        ", ".join(f"{k} {v['name']}" for k, v in sorted(gw.items()))))
    if gw:
        st["gateway"] = gw

    keda = spec.autoscaling.mode == "keda" and not spec.suspend
    keda_scales = keda and SCALED in served and serving
    if keda_scales:
        apply.append(ba.scaled_object(spec, owner))
        st["scaledObject"] = name
        conds.append(cond.Condition(COND_SCALING, "True", "ScaledObjectApplied",
                                    f"KEDA scales the Deployment on {spec.autoscaling.metric}"))
    elif keda and SCALED not in served:
        conds.append(cond.Condition(COND_SCALING, "False", "KEDANotInstalled",
                                    _missing(SCALED) + f"; serving minReplicas ({spec.autoscaling.min_replicas})"))
    elif keda:
        conds.append(cond.Condition(COND_SCALING, "False", "EngineNotServing", "waiting for the serving Deployment"))
    elif status.get("scaledObject"):
        delete.append((*SCALED, name))
    return Exposure(tuple(apply), tuple(delete), tuple(conds), st, keda_scales)
