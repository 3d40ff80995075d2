"""Scale to zero, decided purely: an engine with ``autoscaling.minReplicas: 0`` (mode
``builtin``, ``scaleToZeroAfterSeconds`` set) goes to 0 replicas when nothing has used it for
the idle window, and back to at least 1 as soon as something does.

"Used" is the latest of three times (RFC 3339 strings):
- the Kiln router's annotation ``kiln.dev/last-request-time`` on the InferenceEngine (the
  router writes it when it holds a request for the engine, at once, and while requests for it
  are in flight, every few seconds: ``kiln.operator.router.signal``);
- the builtin autoscaler's last scrape that saw a pod schedule requests (traffic that went to
  the engine's Service directly);
- the resource's creation, and the moment a serving pod last turned ready (its ``Ready``
  condition's ``lastTransitionTime``): an engine that just built, rolled out or scaled up gets
  a whole window to be used before it goes back to zero.

The planner never cuts a start short: with no Deployment yet, or replicas wanted and no pod
ready, the engine counts as used (its first ready pod then starts a whole window).

The decision is level-based (no memory between reconciles): active means
``now - last_used < window``.  A request that arrives while the engine is at zero moves
``last_used`` past the moment it went idle, so the same rule scales it up.  The router's and
the operator's clocks are compared, so they must agree to a few seconds (NTP).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .spec import AutoscalingSpec


def parse_time(stamp: str | None) -> dt.datetime | None:
    """An RFC 3339 time (``...Z`` or with an offset) as an aware datetime; None when empty or
    not a time (a hand-written annotation that does not parse counts as no activity)."""
    if not stamp:
        return None
    try:
        t = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def format_time(t: dt.datetime) -> str:
    """``t`` as RFC 3339 UTC with second precision (``2026-12-04T01:02:03Z``)."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready_since(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """The latest ``lastTransitionTime`` of a ``Ready=True`` condition among ``pods`` (None
    when no pod is ready)."""
    times = [(parse_time(x.get("lastTransitionTime")), x.get("lastTransitionTime"))
             for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")
             for x in (p.get("status") or {}).get("conditions") or []
             if x.get("type") == "Ready" and x.get("status") == "True"]
    times = [(t, s) for t, s in times if t is not None]
    return max(times)[1] if times else None


@dataclass(frozen=True)
class IdleState:
    """Where an engine that scales to zero stands.

    Fields:
        last_used: the latest use (RFC 3339), None when nothing is known.
        active: used within the idle window (at least 1 replica).
        seconds_left: seconds until it goes idle (None when already idle or unknown).
    """

    last_used: str | None
    active: bool
    seconds_left: float | None


def idle_state(scaling: AutoscalingSpec, uses: Iterable[str | None], now: str) -> IdleState:
    """The idle state from the times the engine was used (``uses``: any of them None or
    unparsable) at ``now``.  With no known use at all the engine is active (it is new)."""
    times = [t for t in (parse_time(u) for u in uses) if t is not None]
    if not times:
        return IdleState(None, True, None)
    last = max(times)
    window = float(scaling.scale_to_zero_after_seconds or 0)
    now_t = parse_time(now)
    assert now_t is not None, f"now is not an RFC 3339 time: {now!r}"
    left = window - (now_t - last).total_seconds()
    if left > 0:
        return IdleState(format_time(last), True, left)
    return IdleState(format_time(last), False, None)


def engine_idle(scaling: AutoscalingSpec, uses: Iterable[str | None], serving_pods: Iterable[Mapping[str, Any]],
                deployment: Mapping[str, Any] | None, now: str) -> IdleState:
    """The idle state of an engine that scales to zero: ``uses`` (the router's annotation, the
    autoscaler's last active scrape, the resource's creation) and its pods' last readiness, at
    ``now``; a first start (no Deployment) or a start with no replica ready yet is active."""
    pods = list(serving_pods)
    state = idle_state(scaling, (*uses, ready_since(pods)), now)
    dep = deployment
    starting = dep is None or (int((dep.get("spec") or {}).get("replicas") or 0) > 0
                               and not int((dep.get("status") or {}).get("readyReplicas") or 0))
    if starting and not state.active:  # a first start or a scale-up in progress is never cut short
        return IdleState(state.last_used, True, None)
    return state
