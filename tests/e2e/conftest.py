"""Fixtures of the end-to-end tests: the whole stack (kiln.devcluster.stack) on a private
plane with one process-backed node and the chart installed; the chart's operator pod runs on
that node (in-cluster, with its ServiceAccount's projected token).  The install sets only the
operator's intervals (resync 10 s, autoscaler scrape 3 s, build progress read 2 s, engine
cache cleanup step 2 s; the defaults are 60 s, 15 s, 10 s and 300 s) and the engine cache retention (15 s instead of 7 days: an
engine no resource of a test uses leaves its claim 15 s later; one whose resources are all
deleted stays, as the claims of namespaces without resources are not looked at) so the tests
take less time.  Pods really run `kiln build` and `kiln serve`.

Binaries of the plane missing: skip (unless CI=true or KILN_PLANE_BUILD=1: build them).
KILN_E2E_PLANE=<name> uses (and keeps) a named plane instead of a private one.
Measured numbers are appended to ``<plane>/e2e-measurements.jsonl`` and printed at the end.
An interrupted run stops the stack it started (the node's pods and the operator are its
children; the private plane is bound to it: kiln.devcluster.procs).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from kiln.devcluster.plane import bin_dir, reap_stale
from kiln.devcluster.stack import Stack
from kiln.devcluster.wait import wait_for

MEASUREMENTS: list[dict] = []
E2E_HELM_VALUES = {"operator.resyncSeconds": "10", "operator.autoscaleSeconds": "3",
                   "operator.buildProgressSeconds": "2",
                   "engineCache.gcSeconds": "2", "engineCache.retentionSeconds": "15"}


@pytest.fixture(scope="session")
def stack():
    build = os.environ.get("KILN_PLANE_BUILD") == "1" or os.environ.get("CI") == "true"
    try:
        bin_dir(build=build)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    named = os.environ.get("KILN_E2E_PLANE")
    reap_stale("e2e-")
    s = Stack(named or f"e2e-{os.getpid()}", log=lambda m: print(f"[e2e {time.strftime('%H:%M:%S')}] {m}", flush=True),
              bind_plane=not named, helm_values=E2E_HELM_VALUES)
    try:
        s.up()
    except BaseException:  # an interrupt or a failure half-way: stop what was started
        s.down(keep_plane=bool(named), remove=not named)
        raise
    yield s
    s.down(keep_plane=bool(named), remove=not named)


@pytest.fixture
def ns(stack, request):
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base or 't'}-{uuid.uuid4().hex[:6]}"
    stack.kubectl("create", "namespace", name)
    wait_for(f"the default ServiceAccount in {name}",
             lambda: stack.kubectl("get", "serviceaccount", "default", "-n", name, "--ignore-not-found"),
             stall=60, interval=0.2)
    yield name
    stack.plane.custom_metrics.clear(name)
    stack.kubectl("delete", "inferenceengines", "--all", "-n", name, "--wait=false", check=False)
    stack.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
    # The node kills the namespace's processes as the pods go; wait so the next test has the CPU
    # (while pods still go away; a pod that hangs in deletion is the next test's problem).
    try:
        stack.wait_for("the namespace's pods gone", lambda: not stack.pods(name), stall=90, interval=1, ns=name)
    except TimeoutError:
        pass


@pytest.fixture
def measure(stack):
    def record(what: str, value, unit: str = "s", **extra):
        row = {"what": what, "value": round(value, 2) if isinstance(value, float) else value, "unit": unit, **extra}
        MEASUREMENTS.append(row)
        with open(Path(stack.plane.dir) / "e2e-measurements.jsonl", "a") as f:
            f.write(json.dumps({"t": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **row}) + "\n")
        print(f"[e2e] MEASURED {what}: {row['value']} {unit} {extra or ''}", flush=True)
    return record


def pytest_terminal_summary(terminalreporter):
    if MEASUREMENTS:
        terminalreporter.section("kiln e2e measurements")
        for m in MEASUREMENTS:
            extra = {k: v for k, v in m.items() if k not in ("what", "value", "unit")}
            terminalreporter.write_line(f"{m['what']}: {m['value']} {m['unit']} {extra or ''}")
