"""The engine cache lifecycle on the test plane (kiln.operator.enginegc): the chart's operator pod
finds an engine that no InferenceEngine uses, and after the retention its cleanup Job (a real
pod on the process node, ``kiln engines gc``) deletes it from the claim's folder, while the
engine a resource uses stays and gets its measured size in its record, in ``status.engine``
and in ``kiln engines list``.

No engine is built here: the engines are folders written onto the claim (what the janitor and
``kiln engines gc`` read: a folder named by the hash, its manifest and files) with the engine
records that a build Job's success leaves (``builders.engine_record``, applied with the
operator's field manager).  The e2e stack's operator runs with a short retention and cleanup
interval (conftest.E2E_HELM_VALUES).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import threading
from pathlib import Path

import pytest

from kiln.common.constants import COMPLETE_MARKER, ENGINE_FORMAT_VERSION, MANIFEST_FILENAME
from kiln.common.enginecache import folder_bytes
from kiln.devcluster.paths import VENV_BIN
from kiln.devcluster.procnode import pod_log_path
from kiln.operator import builders as b
from kiln.operator import constants as c
from kiln.operator.engines_cli import human_bytes
from kiln.operator.kube import Kube, KubeConfig
from kiln.operator.spec import parse_spec

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(900)]

CLAIM = "kiln-engine-cache"
KEEPER = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": "keeper"},
          # suspended: it uses its engine (it would serve it on resume) without serving pods
          "spec": {"model": {"builtin": "smollm2-135m-instruct"}, "suspend": True}}
RETIRED_SPEC = {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"maxSeqLen": 1024}}  # another engine


def operator_arg(stack, flag: str) -> float:
    """A numeric flag of the chart's operator container (its Deployment's args)."""
    dep = json.loads(stack.kubectl("get", "deployment", "kiln", "-n", "kiln-system", "-o", "json"))
    for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]:
        if a.startswith(flag + "="):
            return float(a.split("=", 1)[1])
    raise AssertionError(f"the operator runs without {flag}")


def claim_folder(stack, ns: str) -> Path | None:
    """The host folder behind the namespace's engine cache claim once it is bound."""
    pvc = json.loads(stack.kubectl("get", "pvc", CLAIM, "-n", ns, "-o", "json", "--ignore-not-found") or "{}")
    if (pvc.get("status") or {}).get("phase") != "Bound":
        return None
    pv = json.loads(stack.kubectl("get", "pv", pvc["spec"]["volumeName"], "-o", "json"))
    return Path(pv["spec"]["hostPath"]["path"])


def write_engine(root: Path, h: str, num_weight_bytes: int) -> int:
    """A complete engine folder ``root/h`` (manifest, completion marker, a weights file of
    ``num_weight_bytes``); returns its size on disk in bytes (``folder_bytes``)."""
    d = root / h
    d.mkdir(parents=True)
    (d / MANIFEST_FILENAME).write_text(json.dumps({"format_version": ENGINE_FORMAT_VERSION, "engine_hash": h}))
    (d / "model.safetensors").write_bytes(b"\x01" * num_weight_bytes)
    (d / COMPLETE_MARKER).write_text("")
    return folder_bytes(d)


class RecordWatch(threading.Thread):
    """Every version of the engine records of one hash, from a watch started before they exist
    (a short-lived annotation is seen even when the record is deleted soon after)."""

    def __init__(self, api, ns: str, h: str):
        super().__init__(daemon=True)
        self.api, self.ns, self.h = api, ns, h
        self.events: list[tuple[str, dict]] = []
        self.deleted = threading.Event()
        self.started = threading.Event()
        from kubernetes import watch
        self.w = watch.Watch()

    def run(self) -> None:
        rv = self.api.list_namespaced_config_map(self.ns, label_selector=f"{c.LABEL_ENGINE_HASH}={self.h}") \
            .metadata.resource_version
        self.started.set()
        for ev in self.w.stream(self.api.list_namespaced_config_map, self.ns, resource_version=rv,
                                label_selector=f"{c.LABEL_ENGINE_HASH}={self.h}", timeout_seconds=600):
            obj = self.api.api_client.sanitize_for_serialization(ev["object"])
            self.events.append((ev["type"], obj))
            if ev["type"] == "DELETED":
                self.deleted.set()
                return

    def annotation(self, key: str) -> str | None:
        return next((v for _, o in self.events if (v := (o["metadata"].get("annotations") or {}).get(key))), None)


def parse_time(s: str) -> dt.datetime:
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ")


def test_unused_engine_leaves_the_claim_and_the_used_one_stays_with_its_size(stack, ns):
    retention = operator_arg(stack, "--engine-retention-seconds")
    assert 0 < retention <= 60 and 0 < operator_arg(stack, "--engine-gc-seconds") <= 10, \
        "the e2e stack's operator must run with a short retention and cleanup interval (conftest.E2E_HELM_VALUES)"
    used, old = parse_spec(KEEPER["spec"]).engine_hash, parse_spec(RETIRED_SPEC).engine_hash
    assert used != old
    stack.apply_obj(KEEPER, ns)
    root = stack.wait_for("the engine cache claim bound", lambda: claim_folder(stack, ns), stall=60, ns=ns)

    used_bytes = write_engine(root, used, 3 * 1024 * 1024 + 123)
    write_engine(root, old, 1024 * 1024)
    watch = RecordWatch(stack.api, ns, old)
    watch.start()
    assert watch.started.wait(60)
    admin = Kube(KubeConfig(kubeconfig=stack.plane.kubeconfig))
    try:
        owner = {"name": "keeper", "namespace": ns}
        admin.apply(b.engine_record(parse_spec(KEEPER["spec"]), used, owner, b.job_name(CLAIM, used),
                                    "2026-01-01T00:00:00Z"))
        admin.apply(b.engine_record(parse_spec(RETIRED_SPEC), old, {"name": "retired", "namespace": ns},
                                    b.job_name(CLAIM, old), "2026-01-01T00:00:00Z"))

        stack.wait_for("the unused engine's record deleted", lambda: watch.deleted.is_set(), stall=120, ns=ns)
        assert not (root / old).exists(), "the record went but the engine stayed on the claim"
        assert (root / used).is_dir() and folder_bytes(root / used) == used_bytes, "the engine in use was touched"

        # The cleanup ran as a pod on the node, only after the retention, and asked for the unused engine only.
        logs = sorted((stack.state_dir / "pods").glob(f"{ns}_kiln-gc-*/{c.CONTAINER_NAME}.log"))
        assert len(logs) == 1, logs
        first = logs[0].read_text().splitlines()[0]  # "--- <start> procnode: <command line>"
        started, command = first.split()[1], first.split(" procnode: ", 1)[1]
        assert "kiln engines gc" in command and f"--remove {old}" in command and used not in command, command
        since = watch.annotation(c.ANNOTATION_UNUSED_SINCE)
        assert since is not None and watch.annotation(c.ANNOTATION_DELETING), watch.events
        assert parse_time(started) >= parse_time(since) + dt.timedelta(seconds=retention), (since, started)
        assert logs[0].parent.joinpath(f"{c.CONTAINER_NAME}.termination-log").read_text().startswith("{")

        # The used engine's record, status.engine and `kiln engines list` show its measured size and its user.
        rec_name = b.record_name(CLAIM, used)
        rec = stack.wait_for("the size in the engine record",
                             lambda: (r := admin.get("v1", "ConfigMap", ns, rec_name)) and "sizeBytes" in r["data"] and r,
                             stall=60, ns=ns)
        # its users: the resource by its spec, its Deployment (at zero replicas) by its pod template
        users = [f"{ns}/deployment/keeper", f"{ns}/keeper"]
        assert rec["data"]["sizeBytes"] == str(used_bytes) and rec["data"]["usedBy"] == ",".join(users), rec["data"]
        assert c.ANNOTATION_DELETING not in (rec["metadata"].get("annotations") or {})
        engine = stack.wait_for("status.engine.sizeBytes",
                                lambda: ((stack.engine("keeper", ns) or {}).get("status") or {}).get("engine", {})
                                .get("sizeBytes") and stack.engine("keeper", ns)["status"]["engine"], stall=60, ns=ns)
        assert engine == {"hash": used, "sizeBytes": used_bytes}
    finally:
        watch.w.stop()
        admin.close()

    cli = [str(VENV_BIN / "kiln"), "engines", "list", "-n", ns, "--kubeconfig", stack.plane.kubeconfig]
    rows = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True, check=True).stdout)
    assert [(r["hash"], r["claim"], r["bytes"], r["usedBy"]) for r in rows] == [(used, CLAIM, used_bytes, users)]
    table = subprocess.run(cli, capture_output=True, text=True, check=True).stdout.splitlines()
    assert table[0].split()[:5] == ["NAMESPACE", "CLAIM", "ENGINE", "SIZE", "USED"], table
    assert table[1].split()[:5] == [ns, CLAIM, used, human_bytes(used_bytes), ",".join(users)], table
    assert human_bytes(used_bytes) == "3.0Mi"
    # the claim side of the CLI: what the cleanup Job's image runs on a mounted claim
    local = subprocess.run([str(VENV_BIN / "kiln"), "engines", "list", "--cache-dir", str(root), "--json"],
                           capture_output=True, text=True, check=True).stdout
    assert [(e["hash"], e["bytes"], e["complete"]) for e in json.loads(local)] == [(used, used_bytes, True)]
