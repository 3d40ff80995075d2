"""LoRA adapters in the operator, on plain data: ``spec.adapters`` parsed, the fetch Job's and
the pods' arguments read by the real ``kiln`` parser, the pod template untouched by the list,
and the plan (Jobs, the start list, loads and unloads on ready pods, status, AdapterFailed)."""

from __future__ import annotations

import json

import pytest

from kiln.common.adapterref import BuiltinAdapter
from kiln.operator import adapters as ad
from kiln.operator import builders as b
from kiln.operator.plan import Observed, plan
from kiln.operator.spec import EngineSpecError, parse_spec

NOW = "2026-01-02T03:04:05Z"
OWNER = {"name": "smollm2", "namespace": "team-a", "uid": "u-1"}
HF = {"name": "sql", "huggingFace": {"repo": "org/sql-lora", "revision": "v1", "secretRef": {"name": "hf"},
                                     "endpoint": "http://mirror:9000"}}
PVC = {"name": "chat", "pvc": {"claimName": "loras", "path": "chat/v2"}}
BUILTIN = {"name": "demo", "builtin": {"name": "random", "rank": 8, "seed": 3, "targets": ["v_proj", "q_proj"]}}
RAW = {"model": {"builtin": "smollm2-135m-instruct"}, "replicas": 2, "resources": {"gpus": 0},
       "runtime": {"lora": {"enabled": True}}}


def spec(adapters=(), **runtime_lora):
    raw = json.loads(json.dumps(RAW))
    raw["adapters"] = list(adapters)
    raw["runtime"]["lora"].update(runtime_lora)
    return parse_spec(raw)


def fetch_job(s, a, state):
    j = ad.adapter_job(s, OWNER, a, s.engine_hash)
    j["status"] = {"running": {"active": 1},
                   "succeeded": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]},
                   "failed": {"failed": 2, "conditions": [{"type": "Failed", "status": "True",
                                                           "reason": "BackoffLimitExceeded", "message": "gave up"}]}
                   }[state]
    return j


def served(s, hash_, ready=2):
    d = b.deployment(s, hash_, OWNER, replicas=2)
    d["metadata"]["generation"] = 1
    d["status"] = {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": ready}
    return d


def record(hash_):
    return {"metadata": {"name": b.record_name("kiln-engine-cache", hash_)}, "data": {"engineHash": hash_}}


def observed(s, **fields):
    base = dict(owner=OWNER, generation=2, claim_exists=True, record=record(s.engine_hash),
                deployment=served(s, s.engine_hash))
    return Observed(**{**base, **fields})


def test_adapters_parse_with_defaults_and_keys():
    s = spec([HF, PVC])
    sql, chat = s.adapters
    assert (sql.hf_repo, sql.hf_revision, sql.hf_token.name, sql.hf_token.key) == ("org/sql-lora", "v1", "hf", "token")
    assert (chat.pvc_claim, chat.pvc_path, chat.source) == ("loras", "chat/v2", "pvc://loras/chat/v2")
    assert s.runtime.lora.enabled and (s.runtime.lora.max_loras, s.runtime.lora.max_lora_rank) == (4, 16)
    # the key names the source, not the name; same source -> same folder
    renamed = parse_spec({**RAW, "adapters": [{**PVC, "name": "other"}]}).adapters[0]
    assert renamed.key == chat.key != sql.key and len(chat.key) == 16
    # LoRA is on by default once there are adapters
    assert parse_spec({"model": RAW["model"], "adapters": [PVC]}).runtime.lora.enabled
    assert not parse_spec({"model": RAW["model"]}).runtime.lora.enabled


@pytest.mark.parametrize("adapters, runtime, message", [
    ([PVC, {**HF, "name": "chat"}], {}, "'chat' is given twice"),
    ([{"name": "x", **{k: v for k, v in PVC.items() if k != "name"}, "huggingFace": HF["huggingFace"]}], {},
     "exactly one source"),
    ([{"name": "x"}], {}, "exactly one source"),
    ([{"name": "bad name", "pvc": PVC["pvc"]}], {}, "is not a model name"),
    ([{"name": "x", "pvc": {"claimName": "loras", "path": "../etc"}}], {}, "leaves the claim"),
    ([{"name": "base", "pvc": PVC["pvc"]}], {}, "the base model's served name"),
    ([PVC], {"lora": {"enabled": False}}, "enabled: false"),
    ([PVC], {"lora": {"maxLoraRank": 128}}, "maxLoraRank: expected an integer in 1..64"),
    ([PVC], {"lora": {"maxLoras": 4, "maxCpuLoras": 2}}, "at least maxLoras"),
    ([{**BUILTIN, **PVC, "name": "x"}], {}, "exactly one source of pvc, huggingFace, builtin"),
    ([{"name": "x", "builtin": {"name": "nope"}}], {}, r"adapters\[0\].builtin: unknown builtin adapter 'nope'"),
    ([{"name": "x", "builtin": "random"}], {}, r"adapters\[0\].builtin: expected an object"),
    ([{"name": "x", "builtin": {"name": "random", "rank": 0}}], {}, r"builtin.rank: expected an integer in 1..64"),
    ([{"name": "x", "builtin": {"name": "random", "rank": 65}}], {}, r"builtin.rank: expected an integer in 1..64"),
    ([{"name": "x", "builtin": {"name": "random", "alpha": 0}}], {}, "builtin.alpha: expected a positive number"),
    ([{"name": "x", "builtin": {"name": "random", "seed": -1}}], {}, "builtin.seed: expected an integer"),
    ([{"name": "x", "builtin": {"name": "random", "targets": ["lm_head"]}}], {}, "'lm_head' is not a target"),
    ([{"name": "x", "builtin": {"name": "random", "targets": []}}], {}, "targets: expected a non-empty list"),
    ([{"name": "x", "builtin": {"name": "random", "size": 3}}], {}, "unknown parameter 'size'"),
])
def test_bad_adapter_specs_name_the_field(adapters, runtime, message):
    raw = {"model": {**RAW["model"], "servedModelName": "base"}, "adapters": adapters, "runtime": runtime}
    with pytest.raises(EngineSpecError, match=message):
        parse_spec(raw)


def test_builtin_adapters_parse_to_one_canonical_source_keyed_by_the_engine():
    demo = spec([BUILTIN]).adapters[0]
    assert demo.builtin == BuiltinAdapter("random", rank=8, alpha=8.0, seed=3, targets=("q_proj", "v_proj"))
    assert demo.source == "builtin:random?rank=8&alpha=8&seed=3&targets=q_proj,v_proj"
    assert BuiltinAdapter.from_string(demo.source) == demo.builtin
    # defaults written out, another target order, another name: the same folder
    spelled = {"name": "other", "builtin": {"name": "Random", "rank": 8.0, "alpha": 8, "seed": 3,
                                            "targets": ["q_proj", "v_proj"]}}
    assert spec([spelled]).adapters[0].key == demo.key
    defaults = spec([{"name": "d", "builtin": {"name": "random"}}]).adapters[0]
    assert defaults.source == "builtin:random?rank=16&alpha=16&seed=0&targets=" + ",".join(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # other parameters, or the same ones for another engine: another folder (shaped for that base)
    assert spec([{**BUILTIN, "builtin": {**BUILTIN["builtin"], "seed": 4}}]).adapters[0].key != demo.key
    raw = json.loads(json.dumps(RAW))
    raw.update(adapters=[BUILTIN, PVC], build={"quantization": "fp8"})
    fp8 = parse_spec(raw)
    assert fp8.engine_hash != spec().engine_hash
    assert fp8.adapters[0].base == fp8.engine_hash and fp8.adapters[0].key != demo.key
    assert fp8.adapters[1].key == spec([PVC]).adapters[0].key  # a claim folder is the same for any engine


@pytest.mark.parametrize("source, canonical", [
    ("builtin:random", "builtin:random?rank=16&alpha=16&seed=0&targets=q_proj,k_proj,v_proj,o_proj,gate_proj,"
                       "up_proj,down_proj"),
    (" builtin:RANDOM?seed=9&alpha=0.5&rank=4&targets=down_proj,q_proj ",
     "builtin:random?rank=4&alpha=0.5&seed=9&targets=q_proj,down_proj"),
    ("builtin:random?alpha=1e1&rank=8&seed=0&targets=up_proj", "builtin:random?rank=8&alpha=10&seed=0&targets=up_proj"),
])
def test_builtin_source_strings_round_trip_to_one_spelling(source, canonical):
    ref = BuiltinAdapter.from_string(source)
    assert ref.to_cli() == canonical and BuiltinAdapter.from_string(canonical) == ref
    assert BuiltinAdapter.from_dict(ref.to_dict(), "builtin") == ref


@pytest.mark.parametrize("builtin, message", [
    ({"name": "random", "rank": 0}, "adapters[0].builtin.rank: expected an integer in 1..64, got 0"),
    ({"name": "lora-of-the-day"}, "adapters[0].builtin: unknown builtin adapter 'lora-of-the-day'"),
])
def test_bad_builtin_adapter_is_an_invalid_spec_condition(builtin, message):
    """A builtin the operator cannot make (a resource written past the CRD's checks): the
    reconcile reports Degraded / InvalidSpec naming the field, and creates nothing."""
    from fakekube import FakeKube

    from kiln.operator import constants as c
    from kiln.operator.reconcile import Reconciler, ReconcilerConfig

    kube = FakeKube()
    kube.apply({"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "smollm2", "namespace": "team-a"},
                "spec": {"model": RAW["model"], "adapters": [{"name": "demo", "builtin": builtin}]}})
    out = Reconciler(kube, ReconcilerConfig(emit_events=True)).reconcile(
        kube.get(c.API_VERSION, c.KIND, "team-a", "smollm2"))
    assert out.phase == c.PHASE_DEGRADED
    status = kube.get(c.API_VERSION, c.KIND, "team-a", "smollm2")["status"]
    degraded = next(x for x in status["conditions"] if x["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert message in degraded["message"]
    assert not [k for k in kube.objects if k[1] in ("Job", "Deployment")]


def test_the_lora_example_admits_and_parses_with_builtin_adapters():
    """examples/smollm2-lora.yaml: admitted by the CRD (test_crd checks every example) and
    parsed by the operator into builtin adapters whose fetch Jobs the real parser reads."""
    import yaml

    from crdcheck import ROOT, admit
    from kiln.runtime.cli import build_parser

    obj, errors = admit(yaml.safe_load((ROOT / "examples" / "smollm2-lora.yaml").read_text()))
    assert errors == []
    s = parse_spec(obj["spec"])
    assert [(a.name, a.builtin.rank, a.builtin.targets) for a in s.adapters] == [
        ("demo-a", 16, BuiltinAdapter().targets), ("demo-b", 8, ("q_proj", "v_proj"))]
    assert s.runtime.lora.enabled and s.runtime.lora.max_lora_rank >= max(a.builtin.rank for a in s.adapters)
    for a in s.adapters:
        job = ad.adapter_job(s, {**OWNER, "name": "smollm2-lora"}, a, s.engine_hash)
        fetch = build_parser().parse_args(job["spec"]["template"]["spec"]["containers"][0]["args"])
        assert BuiltinAdapter.from_string(fetch.source) == a.builtin


def test_list_changes_neither_the_engine_nor_the_pod_template():
    none, one, two = spec(), spec([PVC]), spec([PVC, HF])
    assert none.engine_hash == one.engine_hash == two.engine_hash
    d = [b.deployment(x, x.engine_hash, OWNER, replicas=1) for x in (none, one, two)]
    assert d[0] == d[1] == d[2]
    # the rank is a start flag: changing it rolls the pods (the template changes)
    assert b.deployment(spec([PVC], maxLoraRank=32), none.engine_hash, OWNER, replicas=1) != d[0]


def test_generated_arguments_parse_with_the_real_cli():
    from kiln.runtime.cli import build_parser, engine_args_from

    s = spec([HF, PVC, BUILTIN], maxCpuLoras=8)
    ns = build_parser().parse_args(["serve", *b.serve_args(s, s.engine_hash, OWNER)])
    args = engine_args_from(ns)
    assert args.lora_enabled and (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (4, 16, 8)
    assert args.lora_dir == "/engines/.adapters" and args.lora_modules_file == "/etc/kiln/adapters/adapters.json"
    ctr = b.deployment(s, s.engine_hash, OWNER, replicas=1)["spec"]["template"]["spec"]
    mount = next(m for m in ctr["containers"][0]["volumeMounts"] if m["name"] == "adapters")
    assert mount["mountPath"] == "/etc/kiln/adapters"
    assert {"name": "adapters", "configMap": {"name": b.adapter_list_name(OWNER)}} in ctr["volumes"]
    for a in s.adapters:
        job = ad.adapter_job(s, OWNER, a, s.engine_hash)
        ctr = job["spec"]["template"]["spec"]["containers"][0]
        assert ctr["command"] == ["kiln"]
        fetch = build_parser().parse_args(ctr["args"])
        assert fetch.command == "adapter" and fetch.adapter_command == "fetch"
        assert fetch.output == f"/engines/.adapters/{a.key}" and fetch.engine == f"/engines/{s.engine_hash}"
        assert fetch.max_lora_rank == 16 and fetch.termination_log == "/dev/termination-log"
        if a.hf_repo:
            assert fetch.source == "hf://org/sql-lora@v1" and fetch.download_dir == "/engines/.hf-cache"
            env = {e["name"]: e for e in ctr["env"]}
            assert env["HF_ENDPOINT"]["value"] == "http://mirror:9000"
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        elif a.builtin:
            assert fetch.source == "builtin:random?rank=8&alpha=8&seed=3&targets=q_proj,v_proj"
            assert BuiltinAdapter.from_string(fetch.source) == a.builtin and fetch.download_dir is None
            assert [v["name"] for v in job["spec"]["template"]["spec"]["volumes"]] == ["engines", "tmp"]
        else:
            assert fetch.source == "/adapter-source/chat/v2"
            vols = job["spec"]["template"]["spec"]["volumes"]
            assert {"name": "source", "persistentVolumeClaim": {"claimName": "loras", "readOnly": True}} in vols
        assert "resources" not in ctr or "nvidia.com/gpu" not in ctr["resources"].get("limits", {})


def test_no_fetch_before_the_engine_is_built():
    s = spec([PVC])
    p = plan(s, observed(s, record=None, deployment=None), NOW)
    assert not [o for o in p.apply if o["kind"] == "Job" and o["metadata"]["labels"].get(ad.LABEL_ADAPTER_KEY)]
    assert p.status["adapters"] == [{"name": "chat", "source": "pvc://loras/chat/v2", "state": "Pending", "pods": 0}]


def test_fetch_then_load_into_ready_pods():
    s = spec([PVC, HF])
    chat, sql = s.adapters
    pods = (ad.PodAdapters("p-1", "10.0.0.1", {}), ad.PodAdapters("p-2", "10.0.0.2", {"chat": f"/x/{chat.key}"}))
    # built: a Job per adapter, an empty list
    p = plan(s, observed(s, pod_adapters=pods), NOW)
    jobs = [o for o in p.apply if o["kind"] == "Job"]
    assert [j["metadata"]["labels"][ad.LABEL_ADAPTER_KEY] for j in jobs] == [chat.key, sql.key]
    cm = next(o for o in p.apply if o["kind"] == "ConfigMap" and o["metadata"]["name"] == b.adapter_list_name(OWNER))
    kinds = [o["kind"] for o in p.apply]
    assert kinds.index("ConfigMap") < kinds.index("Deployment")  # the pods mount it
    assert json.loads(cm["data"]["adapters.json"]) == {}
    assert [o.op for o in p.lora_ops] == ["unload"]  # p-2 serves chat, not (yet) fetched here
    # chat fetched, sql still running: listed, loaded where missing
    obs = observed(s, pod_adapters=pods, adapter_jobs=(fetch_job(s, chat, "succeeded"), fetch_job(s, sql, "running")))
    p = plan(s, obs, NOW)
    assert not [o for o in p.apply if o["kind"] == "Job"]
    cm = next(o for o in p.apply if o["kind"] == "ConfigMap" and o["metadata"]["name"] == b.adapter_list_name(OWNER))
    assert json.loads(cm["data"]["adapters.json"]) == {"chat": chat.key}
    assert p.lora_ops == (ad.LoRAOp("p-1", "10.0.0.1", "load", "chat", chat.key),)
    # after the call succeeded: the status says both pods serve it
    done = plan(s, obs.__class__(**{**obs.__dict__, "lora_results": (ad.LoRAResult(p.lora_ops[0], 200),)}), NOW)
    assert done.status["adapters"] == [
        {"name": "chat", "source": "pvc://loras/chat/v2", "state": "Loaded", "pods": 2},
        {"name": "sql", "source": "hf://org/sql-lora@v1", "state": "Fetching", "pods": 0}]
    assert done.status["pods"] == [{"name": "p-1", "adapters": ["chat"]}, {"name": "p-2", "adapters": ["chat"]}]
    assert done.phase == "Ready" and done.status["conditions"][3]["status"] == "False"


def test_removed_adapter_is_unloaded_and_its_job_deleted():
    both = spec([PVC, HF])
    chat, sql = both.adapters
    s = spec([PVC])
    pods = (ad.PodAdapters("p-1", "10.0.0.1", {"chat": f"/engines/.adapters/{chat.key}",
                                               "sql": f"/engines/.adapters/{sql.key}"}),)
    p = plan(s, observed(s, pod_adapters=pods, adapter_jobs=(fetch_job(s, chat, "succeeded"),
                                                             fetch_job(both, sql, "succeeded"))), NOW)
    assert p.lora_ops == (ad.LoRAOp("p-1", "10.0.0.1", "unload", "sql"),)
    assert [r.name for r in p.delete if r.kind == "Job"] == [ad.adapter_job_name(OWNER, sql.key)]
    assert p.status["pods"] == [{"name": "p-1", "adapters": ["chat"]}]
    # the same name from another source: unloaded, then loaded from its new folder
    moved = spec([{**PVC, "pvc": {"claimName": "loras", "path": "chat/v3"}}])
    new = moved.adapters[0]
    p = plan(moved, observed(moved, pod_adapters=pods[:1], adapter_jobs=(fetch_job(moved, new, "succeeded"),)), NOW)
    assert [(o.op, o.name, o.path) for o in p.lora_ops] == [("unload", "chat", ""), ("unload", "sql", ""),
                                                           ("load", "chat", new.key)]


def test_failed_fetch_and_refused_load_degrade_while_the_base_serves():
    s = spec([PVC, HF])
    chat, sql = s.adapters
    term = {"name": "x", "state": {"terminated": {"exitCode": 2, "finishedAt": NOW,
                                                  "message": "kiln adapter: error: RankTooLarge: rank 32 is larger"}}}
    failed_pod = {"metadata": {"name": "f", "labels": {"job-name": ad.adapter_job_name(OWNER, chat.key)}},
                  "status": {"containerStatuses": [term]}}
    pods = (ad.PodAdapters("p-1", "10.0.0.1", {}),)
    obs = observed(s, pod_adapters=pods, adapter_jobs=(fetch_job(s, chat, "failed"), fetch_job(s, sql, "succeeded")),
                   adapter_job_pods=(failed_pod,))
    p = plan(s, obs, NOW)
    load = ad.LoRAOp("p-1", "10.0.0.1", "load", "sql", sql.key)
    assert p.lora_ops == (load,) and not [o for o in p.apply if o["kind"] == "Job"]  # no retry of a failed fetch
    refused = ad.LoRAResult(load, 400, "ShapeMismatch", "the adapter was trained for another base model")
    p = plan(s, Observed(**{**obs.__dict__, "lora_results": (refused,)}), NOW)
    by = {a["name"]: a for a in p.status["adapters"]}
    assert (by["chat"]["state"], by["chat"]["reason"]) == ("Failed", "RankTooLarge")
    assert (by["sql"]["state"], by["sql"]["reason"]) == ("Failed", "ShapeMismatch")
    assert "pod p-1" in by["sql"]["message"]
    conds = {x["type"]: x for x in p.status["conditions"]}
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "AdapterFailed")
    assert "adapter chat: RankTooLarge" in conds["Degraded"]["message"]
    assert conds["Available"]["status"] == "True"  # the base keeps serving
    # the Job's own condition when no pod left a termination message
    p = plan(s, observed(s, adapter_jobs=(fetch_job(s, chat, "failed"),)), NOW)
    assert p.status["adapters"][0]["reason"] == "FetchFailed" and "gave up" in p.status["adapters"][0]["message"]


def test_unreachable_pod_is_reported_and_rechecked():
    s = spec([PVC])
    p = plan(s, observed(s, pod_adapters=(ad.PodAdapters("p-1", "10.0.0.1", None, "timed out"),),
                         adapter_jobs=(fetch_job(s, s.adapters[0], "succeeded"),)), NOW)
    assert p.lora_ops == () and p.status["pods"] == [{"name": "p-1", "message": "timed out"}]
    assert p.requeue_after == ad.UNREACHABLE_RECHECK_S


def test_lora_off_deletes_fetch_jobs_and_reports_nothing():
    on = spec([PVC])
    off = parse_spec({"model": RAW["model"], "replicas": 2, "resources": {"gpus": 0}})
    p = plan(off, observed(off, adapter_jobs=(fetch_job(on, on.adapters[0], "succeeded"),)), NOW)
    assert "adapters" not in p.status and p.lora_ops == ()
    assert [r.name for r in p.delete if r.kind == "Job"] == [ad.adapter_job_name(OWNER, on.adapters[0].key)]
    assert not [o for o in p.apply if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-adapters")]


def test_adapters_with_tensor_parallelism_parse_with_the_real_cli():
    """Adapters on a TP = 3 resource: the serve flags of both reach the runtime's EngineArgs
    (which accepts the combination: each rank holds its shard of every slot)."""
    from kiln.runtime.cli import build_parser, engine_args_from

    raw = json.loads(json.dumps(RAW))
    raw["adapters"] = [PVC]
    raw["runtime"]["tensorParallelSize"] = 3  # SmolLM2: 9 heads, 3 KV heads
    s = parse_spec(raw)
    args = engine_args_from(build_parser().parse_args(["serve", *b.serve_args(s, s.engine_hash, OWNER)]))
    assert args.tensor_parallel_size == 3 and args.lora_enabled and args.max_loras == 4
