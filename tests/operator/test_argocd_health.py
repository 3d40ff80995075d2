"""helm/kiln/files/argocd-health.lua, run in a real Lua interpreter (lupa) on InferenceEngine states."""

from pathlib import Path

import pytest

lupa = pytest.importorskip("lupa")

SCRIPT = (Path(__file__).resolve().parents[2] / "helm/kiln/files/argocd-health.lua").read_text()


def health(obj):
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)

    def to_lua(x):
        if isinstance(x, dict):
            return lua.table_from({k: to_lua(v) for k, v in x.items()})
        if isinstance(x, list):
            return lua.table_from([to_lua(v) for v in x])
        return x

    fn = lua.eval("function(obj) " + SCRIPT + " end")
    hs = fn(to_lua(obj))
    return hs["status"], hs["message"]


def ie(gen=1, observed=1, phase="Ready", conditions=()):
    return {"metadata": {"generation": gen}, "status": {"observedGeneration": observed, "phase": phase,
                                                       "readyReplicas": 2, "engineHash": "abc",
                                                       "conditions": list(conditions)}}


def test_states():
    assert health({"metadata": {"generation": 1}})[0] == "Progressing"
    assert health(ie(gen=2, observed=1))[0] == "Progressing"
    assert health(ie()) == ("Healthy", "2 ready replica(s), engine abc")
    st, msg = health(ie(phase="Degraded", conditions=[{"type": "Degraded", "status": "True", "reason": "BuildFailed",
                                                       "message": "DeadlineExceeded"}]))
    assert st == "Degraded" and "BuildFailed" in msg
    assert health(ie(phase="Suspended"))[0] == "Suspended"
    st, msg = health(ie(phase="Building", conditions=[{"type": "Progressing", "status": "True", "message": "building engine abc"}]))
    assert (st, msg) == ("Progressing", "building engine abc")


def test_crash_looping_is_degraded_and_zero_replicas_is_not_progressing_forever():
    st, msg = health(ie(phase="Degraded", conditions=[{"type": "Degraded", "status": "True", "reason": "CrashLoopBackOff",
                                                       "message": "pod x: exit code 1"}]))
    assert st == "Degraded" and "CrashLoopBackOff" in msg
    zero = ie(phase="Deploying", conditions=[{"type": "EngineBuilt", "status": "True"},
                                             {"type": "Progressing", "status": "False", "reason": "ReconcileComplete"}])
    zero["spec"] = {"replicas": 0}
    zero["status"]["replicas"] = 0
    assert health(zero)[0] == "Suspended"


def test_fields_of_unexpected_types_do_not_raise():
    odd = {"metadata": {"generation": "x"}, "status": {"observedGeneration": "2", "phase": 3, "conditions": "no",
                                                     "readyReplicas": "many"}}
    assert health(odd)[0] == "Progressing"
    assert health({"metadata": {}, "status": "weird"})[0] == "Progressing"
