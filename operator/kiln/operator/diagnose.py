"""What is wrong with a child that the API server accepted: pods that crash, cannot start or
cannot be scheduled, a Deployment past its progress deadline, a build that failed.

Pure functions over the objects as the API server returns them; ``now`` is passed in.  Each
answer is a ``Problem`` (a CamelCase reason for the ``Degraded`` condition and a message for
people that carries the kubelet's, the scheduler's or the container's own words), so a
failure after the build reaches the InferenceEngine's status instead of only ``kubectl
describe``.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# A container waiting for one of these will not start without a change (kubelet's reasons).
WAITING_FAILURES = frozenset({
    "CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "ErrImagePull",
    "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "RunContainerError",
})
# A container restarted this often and still not ready is crash-looping, even in the seconds
# between two back-offs when its state says running.
RESTARTS_CRASHLOOP = 3
# A pod may wait this long for a node before the resource says so (a rolling update with
# maxSurge, or a cluster autoscaler adding a node, legitimately leaves a pod pending briefly).
UNSCHEDULABLE_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class Problem:
    """Why a resource is degraded: ``reason`` (CamelCase, the condition's reason) and ``message``."""

    reason: str
    message: str


def _seconds_since(stamp: str | None, now: str) -> float:
    """Seconds from RFC 3339 ``stamp`` to ``now`` (0 when a stamp is missing or malformed)."""
    try:
        a = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
        b = dt.datetime.fromisoformat(now.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return (b - a).total_seconds()


def _terminated_text(term: Mapping[str, Any] | None) -> str:
    """``exit code N (Reason): message`` of a terminated container state, or ''."""
    if not term:
        return ""
    text = f"exit code {term.get('exitCode')}"
    if term.get("reason"):
        text += f" ({term['reason']})"
    msg = str(term.get("message") or "").strip()
    return f"{text}: {msg}" if msg else text


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    st = pod.get("status") or {}
    return list(st.get("initContainerStatuses") or []) + list(st.get("containerStatuses") or [])


def pod_problem(pod: Mapping[str, Any], now: str) -> tuple[Problem | None, float | None]:
    """``(problem, recheck_in)`` of one pod: a container that cannot start or keeps crashing,
    or a pod no node takes for ``UNSCHEDULABLE_GRACE_SECONDS``.  ``recheck_in`` is the
    seconds until a pending pod's wait counts (None: nothing to wait for)."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None, None
    name = meta.get("name", "")
    for cs in _containers(pod):
        state = cs.get("state") or {}
        waiting = state.get("waiting") or {}
        last = (cs.get("lastState") or {}).get("terminated")
        reason = waiting.get("reason")
        restarts = int(cs.get("restartCount") or 0)
        if reason not in WAITING_FAILURES and not (restarts >= RESTARTS_CRASHLOOP and not cs.get("ready")):
            continue
        reason = reason if reason in WAITING_FAILURES else "CrashLoopBackOff"
        text = f"pod {name} container {cs.get('name')}: {reason}"
        if waiting.get("message"):
            text += f": {waiting['message']}"
        if restarts:
            text += f"; {restarts} restarts"
        if last:
            text += f"; last termination: {_terminated_text(last)}"
        return Problem(reason, text), None
    for cd in (pod.get("status") or {}).get("conditions") or []:
        if cd.get("type") == "PodScheduled" and cd.get("status") == "False" and cd.get("reason") == "Unschedulable":
            waited = _seconds_since(cd.get("lastTransitionTime"), now)
            if waited < UNSCHEDULABLE_GRACE_SECONDS:
                return None, UNSCHEDULABLE_GRACE_SECONDS - waited
            return Problem("Unschedulable", f"pod {name} cannot be scheduled: {cd.get('message') or 'no node fits'}"), None
    return None, None


def pods_problem(pods: Iterable[Mapping[str, Any]], now: str) -> tuple[Problem | None, float | None]:
    """The first problem among ``pods`` (by name), and the soonest recheck when none."""
    recheck: float | None = None
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        problem, wait = pod_problem(pod, now)
        if problem is not None:
            return problem, None
        if wait is not None:
            recheck = wait if recheck is None else min(recheck, wait)
    return None, recheck


def deployment_problem(dep: Mapping[str, Any] | None) -> Problem | None:
    """A Deployment its controller gave up on: past ``progressDeadlineSeconds``
    (``Progressing=False``, ``ProgressDeadlineExceeded``) or failing to create pods
    (``ReplicaFailure=True``: a quota, an admission webhook...)."""
    for cd in ((dep or {}).get("status") or {}).get("conditions") or []:
        if cd.get("type") == "Progressing" and cd.get("status") == "False":
            return Problem(cd.get("reason") or "ProgressDeadlineExceeded", cd.get("message") or "")
        if cd.get("type") == "ReplicaFailure" and cd.get("status") == "True":
            return Problem("ReplicaFailure", f"{cd.get('reason') or ''}: {cd.get('message') or ''}".strip(": "))
    return None


# ``kiln build``'s Hub download failures, of the model or of a calibration dataset
# (``kiln.runtime.hub.HubError``: "REASON: message" in its
# termination message) -> the Degraded reason; any other failed build is BuildFailed.
HUB_FAILURE_REASONS = ("ModelNotFound", "DatasetNotFound", "RevisionNotFound", "Unauthorized", "DownloadFailed",
                       "UnsupportedModel")
# an engine that failed its accuracy gate (kiln build exit 3) is AccuracyGateFailed
_HUB_FAILURE = re.compile(r"kiln build: (" + "|".join(HUB_FAILURE_REASONS + ("AccuracyGateFailed",)) + r"): ")


def build_failure_reason(cause: str) -> str:
    """The Degraded reason of a failed build from its cause (``failed_build_cause``): one of
    ``HUB_FAILURE_REASONS`` when the model's download failed, ``AccuracyGateFailed`` when the
    engine failed its accuracy gate (with the measured numbers in the message), else ``BuildFailed``."""
    m = _HUB_FAILURE.search(cause or "")
    return m.group(1) if m else "BuildFailed"


def failed_build_cause(pods: Iterable[Mapping[str, Any]]) -> str:
    """The cause of a failed build from its pods: the newest termination message of the build
    container (``kiln build`` writes it to ``/dev/termination-log``), else its exit code, else
    ''.  The Job's own reason (``BackoffLimitExceeded``) says only that it gave up."""
    best: tuple[str, str] | None = None
    for pod in pods:
        for cs in _containers(pod):
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if not term or int(term.get("exitCode") or 0) == 0:
                continue
            key = str(term.get("finishedAt") or "")
            if best is None or key >= best[0]:
                best = (key, _terminated_text(term))
    return best[1] if best else ""


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
def build_report(pods: Iterable[Mapping[str, Any]]) -> dict | None:
    """The report of a succeeded build (``kiln.common.enginecache.parse_build_report``) from
    the termination message of its newest build container that exited 0, or None."""
    from kiln.common.enginecache import parse_build_report  # noqa: PLC0415

    best: tuple[str, dict] | None = None
    for pod in pods:
        for cs in _containers(pod):
            term = (cs.get("state") or {}).get("terminated")
            if not term or int(term.get("exitCode") or 0) != 0:
                continue
            report = parse_build_report(term.get("message") or "")
            key = str(term.get("finishedAt") or "")
            if report is not None and (best is None or key >= best[0]):
                best = (key, report)
    return best[1] if best else None
