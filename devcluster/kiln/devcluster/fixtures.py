"""Pytest plugin for tests that need the control plane (loaded by tests/conftest.py with
``pytest_plugins = ["kiln.devcluster.fixtures"]``, or ``-p kiln.devcluster.fixtures``).

- `kube_plane` (session): a private plane "pytest-<pid>" for this run, started (~10 s) and removed
  at the end, so concurrent runs never share one. With KILN_PLANE=<name> (e.g. "dev", started by
  `make cluster-up`) it uses that plane instead, starting it if needed and stopping it at the end
  only if this run started it. KILN_PLANE_KEEP=1 keeps whatever it started. When the binaries are
  not built it skips (run `make cluster-build`), unless CI=true or KILN_PLANE_BUILD=1: it builds.
- `namespace` (function): a fresh namespace whose default ServiceAccount exists; deleted after.
- `skip_or_fail_in_ci(reason)`: for a test whose outside piece is missing (CRDs fetched through
  the Go module proxy, the EPP's source, Prometheus, prometheus-adapter): a skip on a machine
  without network, a failure when CI=true, where the piece must be there.

Mark such tests `@pytest.mark.cluster`.

An interrupted run (Ctrl-C, SIGTERM, SIGHUP) stops every plane, operator, pod process and build
it started: the plugin turns SIGTERM and SIGHUP into KeyboardInterrupt so fixture teardowns run,
and what they miss ends at exit or with this process (kiln.devcluster.procs).
"""

from __future__ import annotations

import os
import re
import uuid

import pytest

from kiln.devcluster import procs
from kiln.devcluster.plane import Plane, bin_dir, reap_stale
from kiln.devcluster.wait import wait_for

STARTED: list[tuple[str, float | None]] = []


def skip_or_fail_in_ci(reason: str) -> None:
    """Skips the test, or fails it when CI=true (CI provides every piece: a missing one there
    is a broken pipeline, not a reason to test less)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: a missing piece fails instead of skipping)")
    pytest.skip(reason)  # (plane, seconds from etcd to ready) started by this run


def pytest_configure(config):
    procs.interrupt_on_signals()


def pytest_terminal_summary(terminalreporter):
    """Prints how long each plane this run started took (a measurement, never an assertion)."""
    for name, seconds in STARTED:
        terminalreporter.write_line(f"kiln control plane {name!r}: started from cached binaries in {seconds} s")


@pytest.fixture(scope="session")
def kube_plane():
    # A missing build skips (it takes ~15 min), except where it must not: CI, or KILN_PLANE_BUILD=1.
    build = os.environ.get("KILN_PLANE_BUILD") == "1" or os.environ.get("CI") == "true"
    try:
        bins = bin_dir(build=build)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    named = os.environ.get("KILN_PLANE")
    keep = os.environ.get("KILN_PLANE_KEEP") == "1"
    reap_stale("pytest-")
    plane = Plane(named or f"pytest-{os.getpid()}",
                  num_gpu_nodes=int(os.environ.get("KILN_PLANE_GPU_NODES", "2")),
                  gpus_per_node=int(os.environ.get("KILN_PLANE_GPUS_PER_NODE", "4")), bin=bins, bind=not keep)
    started = not plane.is_healthy()
    plane.up()
    if started:
        STARTED.append((plane.name, plane.state.get("started_s")))
    yield plane
    if started and not keep:
        plane.down(remove=not named)


@pytest.fixture
def namespace(kube_plane, request):
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base or 't'}-{uuid.uuid4().hex[:6]}"
    kube_plane.kubectl("create", "namespace", name)
    wait_for(f"the default ServiceAccount in namespace {name}",
             lambda: kube_plane.kubectl("get", "serviceaccount", "default", "-n", name, "--ignore-not-found"),
             stall=60, interval=0.2)
    yield name
    kube_plane.custom_metrics.clear(name)
    kube_plane.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
