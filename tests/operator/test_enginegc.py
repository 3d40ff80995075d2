"""The engine cache lifecycle: the pure cleanup planner, the claim side (`kiln engines gc`, on
real folders) and the janitor against the in-memory API."""

import json
import os
import shutil

import pytest

from kiln.common.enginecache import GcReport, collect, list_engines, parse_build_report, format_build_report
from kiln.operator import builders as b
from kiln.operator import constants as c
from kiln.operator.enginegc import EngineJanitor, GcSettings, gc_report, plan_gc
from kiln.operator.engines_cli import main as engines_main, record_rows

NS, CLAIM = "team-a", "kiln-engine-cache"
H1, H2, H3 = "1" * 16, "2" * 16, "3" * 16
NOW = "2026-01-10T00:00:00Z"
DAY = 86400


def rec(h, since=None, deleting=None, size=None):
    ann = {}
    if since:
        ann[c.ANNOTATION_UNUSED_SINCE] = since
    if deleting:
        ann[c.ANNOTATION_DELETING] = deleting
    meta = {"name": b.record_name(CLAIM, h), "namespace": NS,
            "labels": {c.LABEL_COMPONENT: c.COMPONENT_RECORD, c.LABEL_CACHE_CLAIM: CLAIM}}
    if ann:
        meta["annotations"] = ann
    data = {"engineHash": h, "claimName": CLAIM}
    if size:
        data["sizeBytes"] = str(size)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def ann(p, h):
    r = next(r for r in p.records if r["data"]["engineHash"] == h)
    return r["metadata"].get("annotations") or {}


def test_unused_engines_are_stamped_then_expire_oldest_first_and_used_ones_never():
    s = GcSettings(retention_seconds=7 * DAY)
    users = {H1: ["team-a/chat"]}
    p = plan_gc(NS, CLAIM, [rec(H1), rec(H2), rec(H3)], users, False, [], NOW, s)
    assert p.job is None and ann(p, H2)[c.ANNOTATION_UNUSED_SINCE] == NOW and c.ANNOTATION_UNUSED_SINCE not in ann(p, H1)
    assert next(r for r in p.records if r["data"]["engineHash"] == H1)["data"]["usedBy"] == "team-a/chat"
    old = [rec(H1, since="2026-01-01T00:00:00Z"), rec(H2, since="2026-01-02T00:00:00Z"), rec(H3, since="2026-01-09T00:00:00Z")]
    p = plan_gc(NS, CLAIM, old, users, False, [], NOW, s)
    args = p.job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--remove") + 1:] == [H2]  # H1 is in use again, H3 is too young
    assert ann(p, H2)[c.ANNOTATION_DELETING] == p.job["metadata"]["name"] and c.ANNOTATION_UNUSED_SINCE not in ann(p, H1)
    # space: the spare ones go oldest first, only while the claim is short of space
    p = plan_gc(NS, CLAIM, old, {}, False, [], NOW, GcSettings(retention_seconds=0, min_free_bytes=10 << 30))
    args = p.job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--remove" not in args and args[args.index("--spare") + 1:args.index("--min-free")] == [H1, H2, H3]
    assert args[-1] == str(10 << 30)


def test_no_cleanup_during_a_build_or_another_cleanup_and_retention_zero_keeps_all():
    old = [rec(H2, since="2026-01-01T00:00:00Z")]
    assert plan_gc(NS, CLAIM, old, {}, True, [], NOW, GcSettings(retention_seconds=DAY)).job is None
    running = {"metadata": {"name": "kiln-gc-x"}, "status": {"active": 1}}
    p = plan_gc(NS, CLAIM, old, {}, False, [(running, None)], NOW, GcSettings(retention_seconds=DAY))
    assert p.job is None and p.delete_jobs == []
    assert plan_gc(NS, CLAIM, old, {}, False, [], NOW, GcSettings(retention_seconds=0)).job is None


def test_a_finished_cleanup_deletes_the_removed_records_and_unmarks_the_rest():
    done = {"metadata": {"name": "kiln-gc-x"}, "status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}
    report = GcReport(removed={H1: 100}, kept={H2: "space"}, engines={H2: 200, H3: 300})
    records = [rec(H1, since="2026-01-01T00:00:00Z", deleting="kiln-gc-x"),
               rec(H2, since="2026-01-01T00:00:00Z", deleting="kiln-gc-x"), rec(H3)]
    p = plan_gc(NS, CLAIM, records, {H3: ["team-a/x"]}, False, [(done, report)], NOW, GcSettings(retention_seconds=30 * DAY))
    assert p.delete_records == [b.record_name(CLAIM, H1)] and p.delete_jobs == ["kiln-gc-x"] and p.job is None
    assert c.ANNOTATION_DELETING not in ann(p, H2)
    sizes = {r["data"]["engineHash"]: r["data"].get("sizeBytes") for r in p.records}
    assert sizes == {H2: "200", H3: "300"}
    failed = {"metadata": {"name": "kiln-gc-y"}, "status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True"}]}}
    p = plan_gc(NS, CLAIM, records[:1], {}, False, [(failed, None)], NOW, GcSettings(retention_seconds=0))
    assert p.delete_records == [] and c.ANNOTATION_DELETING not in ann(p, H1) and p.delete_jobs == ["kiln-gc-y"]


def _engine(root, h, size=1000, complete=True):
    d = root / h
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * size)
    if complete:
        (d / ".kiln-complete").write_text(h)
        (d / "manifest.json").write_text(json.dumps({"format_version": 2, "engine_hash": h}))
    return d


def test_collect_deletes_what_it_is_told_never_an_engine_being_built(tmp_path):
    for h in (H1, H2, H3):
        _engine(tmp_path, h)
    (tmp_path / f".{H3}.tmp-abc").mkdir()  # a build writing H3
    (tmp_path / ".compile-cache").mkdir()
    assert [(e.hash, e.complete, e.building) for e in list_engines(tmp_path)] == [
        (H1, True, False), (H2, True, False), (H3, True, True)]
    r = collect(tmp_path, remove=[H1, H3], spare=[H2], min_free_bytes=0)
    assert set(r.removed) == {H1} and r.kept == {H3: "building", H2: "space"} and set(r.engines) == {H2, H3}
    assert r.removed[H1] > 1000 and (tmp_path / ".compile-cache").is_dir() and not (tmp_path / H1).exists()
    r = collect(tmp_path, spare=[H2], min_free_bytes=1 << 62)  # short of space: the spare one goes
    assert set(r.removed) == {H2}
    with pytest.raises(ValueError, match="not an engine hash"):
        collect(tmp_path, remove=["../etc"])
    # the operator's cleanup runs only while no build does: H3's temporary folder is a killed
    # build's leftover, deleted with it; a leftover without an engine goes too
    (tmp_path / f".{H3}.tmp-abc" / "w.safetensors").write_bytes(b"x" * 500)
    (tmp_path / f".{H1}.tmp-def").mkdir()
    (tmp_path / f".{H1}.tmp-def" / "w").write_bytes(b"y" * 300)
    r = collect(tmp_path, remove=[H3, H1, H2], no_build_running=True)
    assert set(r.removed) == {H3, H1} and r.removed[H1] == 300 and r.removed[H3] > 1500 and r.kept == {H2: "missing"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".compile-cache"]


def test_kiln_engines_gc_and_list_on_a_folder(tmp_path, capsys):
    _engine(tmp_path, H1, size=3000)
    _engine(tmp_path, H2, complete=False)
    head = tmp_path / H3  # what `kiln head fetch` writes: config, weights, the completion marker
    head.mkdir()
    (head / "config.json").write_text("{}")
    (head / "model.safetensors").write_bytes(b"\0" * 10)
    (head / ".kiln-complete").write_text("")
    term = tmp_path / "term"
    term.write_text("")
    assert engines_main(["list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:]}
    assert lines[H1][1] == "engine" and lines[H1][-1] == "complete"
    assert lines[H2][-1] == "incomplete" and lines[H3][1] == "eagle-head" and lines[H3][-1] == "complete"
    assert engines_main(["list", "--cache-dir", str(tmp_path), "--json"]) == 0
    kinds = {e["hash"]: (e["kind"], e["complete"]) for e in json.loads(capsys.readouterr().out)}
    assert kinds[H3] == ("eagle-head", True) and kinds[H1] == ("engine", True) and not kinds[H2][1]
    shutil.rmtree(head)
    assert engines_main(["gc", "--cache-dir", str(tmp_path), "--remove", H1, "--termination-log", str(term)]) == 0
    report = gc_report([{"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 0, "message": term.read_text()}}}]}}])
    assert set(report.removed) == {H1} and set(report.engines) == {H2}
    assert engines_main(["gc", "--cache-dir", str(tmp_path / "nope")]) == 2
    assert engines_main(["gc", "--cache-dir", str(tmp_path), "--remove", "bad"]) == 2


def test_the_build_report_round_trips():
    text = format_build_report(H1, 12345, {"perplexityIncrease": 0.01})
    assert parse_build_report(text) == {"engineHash": H1, "bytes": 12345, "accuracy": {"perplexityIncrease": 0.01}}
    assert parse_build_report("kiln build: error") is None and parse_build_report("kiln build: built {x") is None


def test_janitor_marks_deletes_and_puts_off_a_cleanup_of_an_engine_used_again():
    from fakekube import FakeKube

    kube = FakeKube()
    for r in (rec(H1, since="2026-01-01T00:00:00Z"), rec(H2)):
        kube.apply(r)
    spec = {"model": {"builtin": "smollm2-135m-instruct"}}
    from kiln.common.enginespec import engine_hash
    kube.apply({"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "chat", "namespace": NS}, "spec": spec})
    used = engine_hash(spec)
    kube.apply(rec(used))
    j = EngineJanitor(kube, GcSettings(retention_seconds=DAY))
    (p,) = j.run_once(NS, [CLAIM], NOW)
    job = kube.get("batch/v1", "Job", NS, p.job["metadata"]["name"])
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][-1] == H1
    got = kube.get("v1", "ConfigMap", NS, b.record_name(CLAIM, H1))["metadata"]["annotations"]
    assert got[c.ANNOTATION_DELETING] == job["metadata"]["name"]
    assert kube.get("v1", "ConfigMap", NS, b.record_name(CLAIM, used))["data"]["usedBy"] == f"{NS}/chat"
    rows = record_rows(kube.list("v1", "ConfigMap", NS))
    assert [r["deleting"] is not None for r in rows if r["hash"] == H1] == [True]
    # the Job finishes: its record goes, the Job goes
    kube.set_status("batch/v1", "Job", NS, job["metadata"]["name"],
                    {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]})
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gc-pod", "namespace": NS,
                "labels": {"job-name": job["metadata"]["name"]}}})
    kube.set_status("v1", "Pod", NS, "gc-pod", {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 0, "message": GcReport(removed={H1: 5}, engines={H2: 7}).to_json()}}}]})
    j.run_once(NS, [CLAIM], "2026-01-10T00:05:00Z")
    assert kube.get("v1", "ConfigMap", NS, b.record_name(CLAIM, H1)) is None
    assert kube.get("batch/v1", "Job", NS, job["metadata"]["name"]) is None
    assert kube.get("v1", "ConfigMap", NS, b.record_name(CLAIM, H2))["data"]["sizeBytes"] == "7"

    # a resource that starts using a marked engine between the plan and the Job cancels it
    kube.apply(rec(H3, since="2026-01-01T00:00:00Z"))

    class Racing(EngineJanitor):
        calls = 0

        def users(self, namespace):
            Racing.calls += 1
            out = super().users(namespace)
            if Racing.calls == 2:
                out[(CLAIM, H3)] = [f"{NS}/late"]
            return out

    (p,) = Racing(kube, GcSettings(retention_seconds=DAY)).run_once(NS, [CLAIM], NOW)
    assert p.job is None and not [o for o in kube.list("batch/v1", "Job", NS) if "gc" in o["metadata"]["name"]]
    assert c.ANNOTATION_DELETING not in (kube.get("v1", "ConfigMap", NS, b.record_name(CLAIM, H3))["metadata"].get("annotations") or {})


def test_the_cleanup_jobs_arguments_parse_with_the_real_kiln_engines_parser():
    import argparse

    from kiln.operator.engines_cli import add_engines_args
    from kiln.operator.enginegc import gc_job

    job = gc_job(NS, CLAIM, [H1], [H2, H3], GcSettings(min_free_bytes=10 << 30))
    ctr = job["spec"]["template"]["spec"]["containers"][0]
    assert ctr["command"] == ["kiln", "engines"]
    ns = add_engines_args(argparse.ArgumentParser(prog="kiln engines")).parse_args(ctr["args"])
    assert ns.engines_command == "gc" and ns.remove == [H1] and ns.spare == [H2, H3] and ns.min_free == 10 << 30
    assert ns.no_build_running and ns.cache_dir == c.DEFAULT_CACHE_ROOT
