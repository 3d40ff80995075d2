"""kiln.devcluster.wait: a wait fails on a stall, not on a clock."""

from __future__ import annotations

import itertools
import time

import pytest

from kiln.devcluster.wait import Stalled, log_lines, objects_state, wait_for


def test_returns_the_first_truthy_answer():
    answers = iter([None, [], "done"])
    assert wait_for("x", lambda: next(answers), stall=5, interval=0) == "done"


def test_keeps_waiting_past_the_stall_time_while_progress_changes():
    t0 = time.monotonic()
    ticks = itertools.count()
    # Done after ~0.6 s, three times the stall time; progress changes every check (0.05 s).
    assert wait_for("slow but moving", lambda: time.monotonic() - t0 > 0.6, stall=0.2, interval=0.01,
                    progress=lambda: next(ticks), check_every=0.05)


def test_gives_up_after_the_stall_time_without_change():
    t0 = time.monotonic()
    with pytest.raises(Stalled, match="nothing changed for 0 s"):
        wait_for("stuck", lambda: False, stall=0.3, interval=0.01, progress=lambda: "same", check_every=0.05)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert issubclass(Stalled, TimeoutError)


def test_objects_state_ignores_heartbeats_and_sees_phases():
    pod = {"kind": "Pod", "metadata": {"namespace": "n", "name": "p", "resourceVersion": "1"},
           "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False",
                                                           "lastProbeTime": "t1"}]}}
    beat = {**pod, "metadata": {**pod["metadata"], "resourceVersion": "2"},
            "status": {**pod["status"], "conditions": [{"type": "Ready", "status": "False", "lastProbeTime": "t2"}]}}
    running = {**pod, "status": {**pod["status"], "phase": "Running"}}
    assert objects_state([pod]) == objects_state([beat])
    assert objects_state([pod]) != objects_state([running])


def test_log_lines_do_not_count_http_access_lines(tmp_path):
    f = tmp_path / "pods" / "ns_p_1" / "kiln.log"
    f.parent.mkdir(parents=True)
    f.write_text("loading\n")
    before = log_lines(tmp_path / "pods")
    with f.open("a") as out:
        out.write('INFO:     10.244.250.2:40000 - "GET /ready HTTP/1.1" 200 OK\n')
    assert log_lines(tmp_path / "pods") == before
    with f.open("a") as out:
        out.write("layer 3/30 quantized\n")
    assert log_lines(tmp_path / "pods") != before
