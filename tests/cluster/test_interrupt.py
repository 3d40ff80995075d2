"""An interrupted test run stops what it started (kiln.devcluster.procs): a pytest run in a
subprocess starts bound process groups (or a real control plane), or a process builds the
plane's binaries, and is sent SIGTERM or SIGKILL; afterwards none of its processes may remain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kiln.devcluster.plane import Plane, bin_dir
from kiln.devcluster.wait import log_sizes, wait_for

# A child that starts a grandchild in its process group, then sleeps: the group must go as a whole.
CHILD = ("import subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")

INNER = '''
import json, os, sys, time
from pathlib import Path

import pytest

from kiln.devcluster import procs

OUT = Path(os.environ["INNER_OUT"])


@pytest.fixture(scope="session")
def children():
    ps = [procs.spawn([sys.executable, "-c", {child!r}], what="child", bind=True) for _ in range(2)]
    yield ps
    if os.environ.get("INNER_TEARDOWN") == "1":
        (OUT / "teardown").write_text("ran")
        for p in ps:
            procs.stop_group(p.pid)


def test_blocks(children):
    (OUT / "pids.json").write_text(json.dumps([p.pid for p in children]))
    time.sleep(600)
'''

INNER_PLANE = '''
import json, os, time
from pathlib import Path

OUT = Path(os.environ["INNER_OUT"])


def test_blocks(kube_plane):
    (OUT / "plane.json").write_text(json.dumps({"dir": str(kube_plane.dir), "pids": kube_plane.state["pids"]}))
    time.sleep(600)
'''


def group_members(pgids: set[int]) -> list[int]:
    """Live (not zombie) processes whose process group is one of pgids."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) in pgids:
            out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def start(tmp_path: Path, source: str, marker: str, **env: str) -> tuple[subprocess.Popen, dict | list]:
    """Runs source as a test file in a pytest subprocess (with the devcluster plugin) and waits
    until its test wrote marker (JSON); returns the process and marker's content."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(source))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_PLANE")}, "INNER_OUT": str(tmp_path), **env}
    with open(tmp_path / "inner.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "kiln.devcluster.fixtures",
                              "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
                              str(tmp_path / "test_inner.py")], stdout=log, stderr=subprocess.STDOUT, env=env,
                             cwd=tmp_path)
    wait_for(f"the inner run's {marker}", lambda: (tmp_path / marker).exists() or p.poll() is not None,
             stall=120, interval=0.2, progress=lambda: log_sizes(tmp_path, "inner.log"))
    assert p.poll() is None, (tmp_path / "inner.log").read_text()
    time.sleep(0.2)  # the marker is written in one call; let it land
    return p, json.loads((tmp_path / marker).read_text())


@pytest.mark.parametrize("teardown", [True, False], ids=["fixture-teardown", "at-exit"])
def test_sigterm_stops_every_bound_process_group(tmp_path, teardown):
    p, pids = start(tmp_path, INNER.format(child=CHILD), "pids.json", INNER_TEARDOWN="1" if teardown else "0")
    wait_for("the grandchildren", lambda: len(group_members(set(pids))) == 2 * len(pids), stall=60, interval=0.1)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=60)
    log = (tmp_path / "inner.log").read_text()
    assert rc == pytest.ExitCode.INTERRUPTED, log
    assert (tmp_path / "teardown").exists() == teardown, log
    wait_for("no process of the run left", lambda: not group_members(set(pids)), stall=15, interval=0.1)


def test_sigkill_of_the_owner_stops_its_bound_children(tmp_path):
    p, pids = start(tmp_path, INNER.format(child="import time; time.sleep(600)"), "pids.json", INNER_TEARDOWN="1")
    p.kill()  # nothing of the owner runs: the kernel's parent-death signal is what stops them
    p.wait(timeout=30)
    wait_for("the children gone", lambda: not any(alive(x) for x in pids), stall=15, interval=0.1)


@pytest.mark.cluster
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_interrupted_run_stops_its_control_plane(tmp_path, sig):
    try:
        bin_dir(build=False)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    p, plane = start(tmp_path, INNER_PLANE, "plane.json")
    pids = list(plane["pids"].values())
    assert pids and all(alive(x) for x in pids)
    p.send_signal(sig)
    p.wait(timeout=120)
    try:
        try:
            wait_for("the plane's processes gone", lambda: not any(alive(x) for x in pids), stall=30, interval=0.2)
        except TimeoutError as e:
            pytest.fail(f"{e}: left {[cmdline(x).split()[0].rsplit('/', 1)[-1] for x in pids if alive(x)]}")
        if sig == signal.SIGTERM:  # the fixture's teardown ran: the private plane is removed
            assert not Path(plane["dir"]).exists(), (tmp_path / "inner.log").read_text()
    finally:
        d = Path(plane["dir"])
        Plane(d.name, home=d.parent).down(quiet=True, remove=True)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def members_naming(text: str) -> list[int]:
    """Live processes whose command line contains text."""
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and alive(int(d.name)) and text in cmdline(int(d.name))]


@pytest.mark.cluster
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_interrupted_build_stops_go(tmp_path, sig):
    """bin_dir(build=True) into an empty cache folder (the Go module and build caches of the
    real build make it start at once), interrupted while go builds: no go process may remain."""
    try:
        bin_dir(build=False)  # the module cache is there: nothing is downloaded
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    cache = tmp_path / "cache"
    code = ("from kiln.devcluster import procs; procs.interrupt_on_signals(); "
            "from kiln.devcluster.plane import bin_dir; bin_dir()")
    with open(tmp_path / "build.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "KILN_CLUSTER_CACHE": str(cache)})
    try:
        wait_for("go building into the empty cache", lambda: any(
            "go build" in cmdline(x) for x in members_naming(str(cache))) or p.poll() is not None,
            stall=120, interval=0.2, progress=lambda: log_sizes(tmp_path, "build.log"))
        assert p.poll() is None, (tmp_path / "build.log").read_text()
        p.send_signal(sig)
        p.wait(timeout=60)
        wait_for("no build process left", lambda: not members_naming(str(cache)), stall=30, interval=0.2)
    finally:
        for x in members_naming(str(cache)):
            os.kill(x, signal.SIGKILL)
