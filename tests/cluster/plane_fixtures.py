"""Pytest fixtures for tests that need the control plane (registered by the root conftest.py).

- `kube_plane` (session): the plane named $KILN_PLANE (default "pytest"); reused when it already
  runs healthy, else started (building the binaries first if they are missing) and stopped at the
  end of the run unless KILN_PLANE_KEEP=1 or it was already running. When the binaries are not
  built it skips (run `make cluster-build`), unless CI=true or KILN_PLANE_BUILD=1: then it builds.
- `namespace` (function): a fresh namespace whose default ServiceAccount exists; deleted after.

Mark such tests `@pytest.mark.cluster`.
"""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plane import Plane, bin_dir  # noqa: E402


@pytest.fixture(scope="session")
def kube_plane():
    # A missing build skips (it takes ~15 min), except where it must not: CI, or KILN_PLANE_BUILD=1.
    build = os.environ.get("KILN_PLANE_BUILD") == "1" or os.environ.get("CI") == "true"
    try:
        bins = bin_dir(build=build)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    plane = Plane(os.environ.get("KILN_PLANE", "pytest"),
                  num_gpu_nodes=int(os.environ.get("KILN_PLANE_GPU_NODES", "2")),
                  gpus_per_node=int(os.environ.get("KILN_PLANE_GPUS_PER_NODE", "4")), bin=bins)
    started = not plane.is_healthy()
    plane.up()
    yield plane
    if started and os.environ.get("KILN_PLANE_KEEP") != "1":
        plane.down()


@pytest.fixture
def namespace(kube_plane, request):
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base or 't'}-{uuid.uuid4().hex[:6]}"
    kube_plane.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 30
    while not kube_plane.kubectl("get", "serviceaccount", "default", "-n", name, "--ignore-not-found"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in namespace {name}")
        time.sleep(0.2)
    yield name
    kube_plane.custom_metrics.clear(name)
    kube_plane.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
