"""The operator pod's endpoint: liveness follows the work loop, a standby is ready, metrics."""

import socket
import urllib.error
import urllib.request

from kiln.operator.health import serve_health


def get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_standby_is_live_and_ready_and_a_stalled_leader_is_not_live():
    state = {"leading": False, "alive": False}
    port = free_port()
    srv = serve_health(port, lambda: state["leading"], host="127.0.0.1", alive=lambda: state["alive"],
                       metrics=lambda: "kiln_operator_reconciles_total 3\n")
    try:
        assert get(port, "/healthz")[0] == 200  # a standby waiting for the Lease
        assert get(port, "/readyz") == (200, "ok: standby\n")
        state["leading"] = True
        assert get(port, "/healthz")[0] == 503  # the leader's work loop stalled
        state["alive"] = True
        assert get(port, "/healthz")[0] == 200 and get(port, "/readyz") == (200, "ok: leader\n")
        assert "kiln_operator_reconciles_total 3" in get(port, "/metrics")[1]
    finally:
        srv.shutdown()


def test_controller_metrics_text_and_liveness():
    from kiln.operator.controller import Controller

    from fakekube import FakeKube

    ctl = Controller(FakeKube())
    assert not ctl.alive()  # not started
    text = ctl.metrics_text()
    for name in ("kiln_operator_reconciles_total", "kiln_operator_reconcile_errors_total",
                 "kiln_operator_queue_depth", "kiln_operator_reconcile_seconds_total"):
        assert f"# TYPE {name}" in text
