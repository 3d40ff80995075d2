"""Standard status conditions (``type``, ``status``, ``reason``, ``message``,
``observedGeneration``, ``lastTransitionTime``), as ``metav1.Condition`` defines them.

Pure: the caller passes the clock.  ``lastTransitionTime`` changes only when ``status``
changes, so recomputing the same state twice writes the same status (no churn, no event).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .constants import CONDITION_TYPES


def now_rfc3339() -> str:
    """The current UTC time in RFC 3339 with second precision (what the API server stores)."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Condition:
    """A desired condition: ``status`` is ``"True"``, ``"False"`` or ``"Unknown"``;
    ``reason`` is CamelCase; ``message`` is for people."""

    type: str
    status: str
    reason: str
    message: str = ""


def merge_conditions(old: Iterable[Mapping[str, Any]] | None, new: Iterable[Condition],
                     generation: int, now: str) -> list[dict[str, Any]]:
    """The conditions list to write: ``new`` in ``CONDITION_TYPES`` order, each keeping the old
    ``lastTransitionTime`` when its status did not change."""
    by_type = {c.get("type"): c for c in (old or [])}
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    out = []
    for cond in sorted(new, key=lambda c: order.get(c.type, len(order))):
        prev = by_type.get(cond.type)
        ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == cond.status else None
        out.append({"type": cond.type, "status": cond.status, "reason": cond.reason,
                    "message": cond.message, "observedGeneration": generation,
                    "lastTransitionTime": ltt or now})
    return out


def transitions(old: Iterable[Mapping[str, Any]] | None,
                new: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Conditions of ``new`` whose status or reason differs from ``old`` (what deserves an Event)."""
    by_type = {c.get("type"): c for c in (old or [])}
    out = []
    for cond in new:
        prev = by_type.get(cond["type"])
        if prev is None or prev.get("status") != cond["status"] or prev.get("reason") != cond["reason"]:
            out.append(dict(cond))
    return out


def get(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    """The condition of ``type_`` in a list, or None."""
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None
