"""Pure manifest builders: (spec, hash, owner) -> dict."""

import copy

import pytest

from kiln.operator import builders as b
from kiln.operator import builders_autoscaling as ba
from kiln.operator import constants as c
from kiln.common.enginespec import engine_hash

OWNER = {"name": "smollm2", "namespace": "team-a", "uid": "u-1"}
SPEC = {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "int4-awq"},
        "runtime": {"maxNumSeqs": 32, "kvCacheMemoryFraction": 0.8},
        "resources": {"gpus": 1, "nodeSelector": {"gpu": "h200"},
                      "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                      "requests": {"memory": "16Gi"}},
        "rollout": {"maxSurge": 0, "maxUnavailable": 1, "startupTimeoutSeconds": 600}}
H = engine_hash(SPEC)


def container(obj):
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_builders_are_pure_and_deterministic():
    spec = copy.deepcopy(SPEC)
    a = b.deployment(spec, H, OWNER, replicas=2)
    assert a == b.deployment(spec, H, OWNER, replicas=2)
    assert spec == SPEC  # input not mutated
    assert b.build_job(spec, H, OWNER) == b.build_job(spec, H, OWNER)


def test_deployment_runs_the_engine_with_its_hash_in_the_pod_template():
    d = b.deployment(SPEC, H, OWNER, replicas=2)
    assert d["spec"]["replicas"] == 2
    assert d["spec"]["template"]["metadata"]["labels"][c.LABEL_ENGINE_HASH] == H
    assert c.LABEL_ENGINE_HASH not in d["spec"]["selector"]["matchLabels"]  # selectors are immutable
    ctr = container(d)
    assert ctr["command"] == ["kiln", "serve"]
    args = ctr["args"]
    assert args[args.index("--engine") + 1] == f"/engines/{H}"
    assert args[args.index("--port") + 1] == "8000"
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert args[args.index("--kv-cache-memory-fraction") + 1] == "0.8"
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert ctr["resources"]["requests"]["memory"] == "16Gi"
    assert ctr["startupProbe"]["httpGet"]["path"] == "/ready"
    assert ctr["startupProbe"]["failureThreshold"] * ctr["startupProbe"]["periodSeconds"] >= 600
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/health"
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    pod = d["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h200"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    assert mounts["/engines"]["readOnly"] is True
    assert d["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_deployment_without_replicas_leaves_them_to_the_hpa():
    assert "replicas" not in b.deployment(SPEC, H, OWNER, replicas=None)["spec"]


def test_cpu_engine_requests_no_gpu():
    spec = {**SPEC, "resources": {"gpus": 0}}
    ctr = container(b.deployment(spec, H, OWNER, replicas=1))
    assert "nvidia.com/gpu" not in str(ctr.get("resources"))
    assert ctr["args"][ctr["args"].index("--device") + 1] == "cpu"


def test_build_job_builds_into_the_hash_path_with_limits():
    j = b.build_job({**SPEC, "build": {"quantization": "int4-awq", "backoffLimit": 2, "activeDeadlineSeconds": 900}}, H, OWNER)
    assert j["metadata"]["name"] == f"kiln-build-{H}-kiln-engine-cache"
    assert j["metadata"]["ownerReferences"] == [b.owner_ref(OWNER, controller=False)]
    assert j["spec"]["backoffLimit"] == 2 and j["spec"]["activeDeadlineSeconds"] == 900
    ctr = container(j)
    assert ctr["command"] == ["kiln", "build"]
    args = ctr["args"]
    assert args[args.index("--output") + 1] == f"/engines/{H}"
    assert args[args.index("--model") + 1] == "builtin:smollm2-135m-instruct"
    assert args[args.index("--quantization") + 1] == "int4-awq"
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == "1"  # AWQ calibrates on the GPU
    assert j["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_uncalibrated_build_needs_no_gpu_and_pvc_sources_are_mounted():
    spec = {"model": {"pvc": {"claimName": "models", "path": "llama/model.gguf"}}, "build": {"quantization": "none"}}
    j = b.build_job(spec, "0" * 16, OWNER)
    ctr = container(j)
    assert "nvidia.com/gpu" not in str(ctr.get("resources"))
    # fp8 calibrates (GPTQ-compensated weights): its build gets a GPU
    fp8 = container(b.build_job({**spec, "build": {"quantization": "fp8"}}, "0" * 16, OWNER))
    assert fp8["resources"]["limits"]["nvidia.com/gpu"] == "1"
    a = ctr["args"]  # hashed as the claim path, read where the claim is mounted
    assert a[a.index("--model") + 1] == "pvc://models/llama/model.gguf" and a[a.index("--models-mount") + 1] == "/models"
    vols = {v["name"]: v for v in j["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_service_and_endpoint():
    s = b.service(SPEC, OWNER)
    assert s["spec"]["ports"][0]["port"] == 8000
    assert s["spec"]["selector"] == b.selector_labels(OWNER)
    assert b.endpoint(OWNER) == "http://smollm2.team-a.svc:8000/v1"


def test_hpa_targets_the_deployment_on_the_queue_time_pods_metric():
    spec = {**SPEC, "autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 6, "targetQueueTimeSeconds": 0.25,
                                    "scaleDownStabilizationSeconds": 120}}
    a = ba.hpa(spec, OWNER)
    assert a["apiVersion"] == "autoscaling/v2"
    assert a["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "smollm2"}
    m = a["spec"]["metrics"][0]
    assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == "kiln_request_queue_time_seconds"
    assert m["pods"]["target"] == {"type": "AverageValue", "averageValue": "250m"}
    assert (a["spec"]["minReplicas"], a["spec"]["maxReplicas"]) == (2, 6)
    assert a["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120


def test_cache_claim_and_record_are_not_owned():
    pvc = b.cache_claim(SPEC, OWNER)
    assert "ownerReferences" not in pvc["metadata"] and pvc["metadata"]["name"] == "kiln-engine-cache"
    rec = b.engine_record(SPEC, H, OWNER, "job", "2026-01-01T00:00:00Z")
    assert "ownerReferences" not in rec["metadata"] and rec["data"]["engineHash"] == H


def test_names_fit_dns_labels():
    long = {"name": "x" * 63, "namespace": "n", "uid": "u"}
    assert len(b.job_name("c" * 63, H)) <= 63
    assert b.job_name("c" * 63, H) != b.job_name("c" * 62 + "d", H)
    assert len(b.deployment_name(long)) <= 63
    assert b.to_quantity(0.5) == "500m" and b.to_quantity(3) == "3" and b.to_quantity(0.001) == "1m"


def test_build_job_args_are_kiln_builds_flags_and_give_the_operators_hash():
    import argparse

    import pytest

    build = pytest.importorskip("kiln.runtime.build_cli")
    for spec in [SPEC, {"model": {"builtin": "smollm2-135m-instruct", "checksum": "sha256:" + "a" * 64},
                        "build": {"quantization": "int8-smoothquant", "smoothquantAlpha": "750m", "kvCacheDtype": "fp8"}},
                 {"model": {"builtin": "smollm2-135m-instruct"}, "build": {"quantization": "auto"}}]:
        h = engine_hash(spec)
        args = container(b.build_job(spec, h, OWNER))["args"]
        a = build.add_build_args(argparse.ArgumentParser()).parse_args(args)
        from kiln.common.enginespec import BuildSpec
        got = BuildSpec.from_cli(a.model, quantization=a.quantization, group_size=a.group_size,
                                 smoothquant_alpha=a.smoothquant_alpha, kv_cache_dtype=a.kv_cache_dtype,
                                 calibration_samples=a.calibration_samples, max_seq_len=a.max_seq_len,
                                 max_batch_size=a.max_batch_size, max_num_tokens=a.max_num_tokens,
                                 checksum=a.source_checksum)
        assert got.hash() == h and a.output == f"/engines/{h}"


def test_serving_pods_keep_the_triton_cache_on_the_engine_claim():
    d = b.deployment(SPEC, H, OWNER, replicas=1)
    pod = d["spec"]["template"]["spec"]
    ctr = container(d)
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["engines"]["persistentVolumeClaim"]["readOnly"] is False  # the mounts decide
    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    assert mounts["/engines"]["readOnly"] is True  # engines stay read-only for the server
    cache = mounts[c.COMPILE_CACHE_MOUNT]
    assert cache["name"] == "engines" and cache["subPath"] == c.COMPILE_CACHE_SUBPATH and not cache.get("readOnly")
    env = {e["name"]: e["value"] for e in ctr["env"]}
    assert env["TRITON_CACHE_DIR"] == f"{c.COMPILE_CACHE_MOUNT}/triton"
    # the build Job creates the folder as the pods' user (kiln.runtime.compile_cache)
    job_env = {e["name"]: e.get("value") for e in container(b.build_job(SPEC, H, OWNER))["env"]}
    assert job_env["KILN_COMPILE_CACHE_DIR"] == f"/engines/{c.COMPILE_CACHE_SUBPATH}"

    off = copy.deepcopy(SPEC)
    off["runtime"]["compileCache"] = False
    d = b.deployment(off, H, OWNER, replicas=1)
    assert {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}["engines"][
        "persistentVolumeClaim"]["readOnly"] is True
    assert c.COMPILE_CACHE_MOUNT not in {m["mountPath"] for m in container(d)["volumeMounts"]}
    assert "TRITON_CACHE_DIR" not in {e["name"] for e in container(d)["env"]}

    rox = copy.deepcopy(SPEC)  # a claim that mounts only read-only: no writable subPath on it
    rox["storage"] = {"claimName": "engines", "create": False, "accessModes": ["ReadOnlyMany"]}
    d = b.deployment(rox, H, OWNER, replicas=1)
    assert c.COMPILE_CACHE_MOUNT not in {m["mountPath"] for m in container(d)["volumeMounts"]}
    assert {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}["engines"][
        "persistentVolumeClaim"]["readOnly"] is True

    own = copy.deepcopy(SPEC)
    own["runtime"]["env"] = [{"name": "TRITON_CACHE_DIR", "value": "/tmp/mine"}]
    env = [e for e in container(b.deployment(own, H, OWNER, replicas=1))["env"] if e["name"] == "TRITON_CACHE_DIR"]
    assert env == [{"name": "TRITON_CACHE_DIR", "value": "/tmp/mine"}]  # the user's own setting wins, once


def test_serve_args_parse_with_the_real_kiln_serve_parser():
    """Every flag the Deployment passes is one `kiln serve` accepts (its own parser, not a copy)."""
    cli = pytest.importorskip("kiln.runtime.cli")
    spec = {**SPEC, "runtime": {"maxNumSeqs": 32, "maxNumBatchedTokens": 2048, "maxModelLen": 2048, "blockSize": 32,
                                "kvCacheMemoryFraction": 0.5, "schedulerPolicy": "guaranteed_no_evict"},
            "resources": {"gpus": 1}}
    for s in (SPEC, spec, {**SPEC, "resources": {"gpus": 0}}):
        ctr = container(b.deployment(s, H, OWNER, replicas=1))
        ns = cli.build_parser().parse_args(ctr["command"][1:] + ctr["args"])
        assert ns.command == "serve" and ns.engine == f"/engines/{H}" and ns.port == 8000
    ns = cli.build_parser().parse_args(["serve"] + container(b.deployment(spec, H, OWNER, replicas=1))["args"])
    assert (ns.max_num_seqs, ns.max_num_batched_tokens, ns.max_model_len, ns.block_size) == (32, 2048, 2048, 32)
    assert ns.scheduler_policy == "guaranteed_no_evict" and ns.device == "cuda"
    from kiln.operator.spec import EngineSpecError, parse_spec

    # tensor parallelism: the flag parses, one GPU per rank, /dev/shm memory-backed
    tp = {**SPEC, "model": {"huggingFace": {"repo": "org/llama"}}, "runtime": {"tensorParallelSize": 2}}
    dep = b.deployment(tp, H, OWNER, replicas=1)
    ns = cli.build_parser().parse_args(["serve"] + container(dep)["args"])
    assert ns.tensor_parallel_size == 2
    assert container(dep)["resources"]["limits"]["nvidia.com/gpu"] == "2"
    vols = dep["spec"]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in vols
    # the builtin SmolLM2 has 9 heads and 3 KV heads: 3 splits them, 2 does not (before any pod)
    assert parse_spec({**SPEC, "runtime": {"tensorParallelSize": 3}}).runtime.tensor_parallel_size == 3
    with pytest.raises(EngineSpecError, match="does not split the model's 9 attention heads"):
        parse_spec({**SPEC, "runtime": {"tensorParallelSize": 2}})


def test_api_key_comes_from_the_secret_and_probes_stay_open():
    spec = {**SPEC, "runtime": {"apiKeySecretRef": {"name": "kiln-key", "key": "token"}}}
    ctr = container(b.deployment(spec, H, OWNER, replicas=1))
    env = {e["name"]: e for e in ctr["env"]}
    assert env["KILN_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "kiln-key", "key": "token"}}
    assert "--api-key" not in ctr["args"]  # never in the pod spec in clear
    assert ctr["startupProbe"]["httpGet"]["path"] == "/ready" and ctr["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "httpHeaders" not in ctr["readinessProbe"]["httpGet"]


def test_dotted_and_long_names_give_valid_child_names():
    import re

    for name in ("llama-3.1-8b", "9lives", "a" * 253, "a." * 100 + "b"):
        owner = {**OWNER, "name": name}
        svc = b.service(SPEC, owner)["metadata"]["name"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", svc) and len(svc) <= 63, svc
        for v in b.labels(owner, "server").values():
            assert len(v) <= 63 and re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", v), v
    assert b.deployment_name({**OWNER, "name": "llama-3.1-8b"}) != b.deployment_name({**OWNER, "name": "llama-3-1-8b"})
    assert b.deployment_name(OWNER) == "smollm2"
    assert b.label_value("x" * 70 + "a") != b.label_value("x" * 70 + "b")


def test_build_scratch_and_shm_have_size_limits_and_the_termination_log_is_kept():
    j = b.build_job(SPEC, H, OWNER)
    ctr = container(j)
    tmp = next(v for v in j["spec"]["template"]["spec"]["volumes"] if v["name"] == "tmp")
    assert tmp["emptyDir"]["sizeLimit"] == "64Gi" and ctr["resources"]["requests"]["ephemeral-storage"] == "64Gi"
    assert ctr["args"][ctr["args"].index("--termination-log") + 1] == "/dev/termination-log"
    assert ctr["terminationMessagePolicy"] == "FallbackToLogsOnError"
    dep = b.deployment(SPEC, H, OWNER, replicas=1)
    shm = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}


def test_build_calibration_from_a_claim_is_mounted_and_gives_the_operators_hash(tmp_path):
    """build.calibration on a claim: the Job mounts it read-only and passes --calibration-data
    and --calibration-checksum; the real `kiln build` parser takes them, and the CLI's spec,
    made from a file with those bytes, has the operator's hash (the hash names the bytes)."""
    import argparse
    import hashlib

    build = pytest.importorskip("kiln.runtime.build_cli")
    from kiln.common.enginespec import BuildSpec, CalibrationRef

    data = tmp_path / "mine.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    sha = "sha256:" + hashlib.sha256(data.read_bytes()).hexdigest()
    spec = copy.deepcopy(SPEC)
    spec["build"] = {"quantization": "int4-gptq", "groupSize": 64,
                     "calibration": {"pvc": {"claimName": "datasets", "path": "/cal/mine.jsonl"}, "checksum": sha}}
    h = engine_hash(spec)
    assert h != engine_hash({**spec, "build": {"quantization": "int4-gptq", "groupSize": 64}})  # not the default data
    job = b.build_job(spec, h, OWNER)
    ctr, pod = container(job), job["spec"]["template"]["spec"]
    a = build.add_build_args(argparse.ArgumentParser()).parse_args(ctr["args"])
    assert a.calibration_data == "/calibration/cal/mine.jsonl" and a.calibration_checksum == sha
    assert {"name": "calibration", "mountPath": "/calibration", "readOnly": True} in ctr["volumeMounts"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["calibration"]["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}
    got = BuildSpec.from_cli(a.model, quantization=a.quantization, group_size=a.group_size,
                             calibration_samples=a.calibration_samples, max_seq_len=a.max_seq_len,
                             max_batch_size=a.max_batch_size, max_num_tokens=a.max_num_tokens,
                             calibration=CalibrationRef(kind="path", path=str(data), checksum=sha))
    assert got.hash() == h
    # a build that does not calibrate ignores the data: no mount, no flag, the same hash as without it
    plain = {"model": SPEC["model"], "build": {"quantization": "none", "calibration": spec["build"]["calibration"]}}
    job = b.build_job(plain, engine_hash(plain), OWNER)
    assert "--calibration-data" not in container(job)["args"]
    assert "calibration" not in {v["name"] for v in job["spec"]["template"]["spec"]["volumes"]}
    assert engine_hash(plain) == engine_hash({"model": SPEC["model"]})


POD = {
    "annotations": {"sidecar.istio.io/inject": "false"},
    "labels": {"team": "search", "cost-center": "42"},
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": {"kiln.dev/engine": "smollm2"}}}}]},
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu.product", "operator": "In", "values": ["H200"]}]}]}}},
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"},
        {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
         "labelSelector": {"matchLabels": {"team": "search"}}}],
    "priorityClassName": "inference-high", "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "registry-a"}, {"name": "registry-b"}],
}


def test_pod_overrides_reach_the_serving_pods():
    spec = {**SPEC, "pod": POD, "resources": {**SPEC["resources"], "requests": {"cpu": "4", "memory": "16Gi"},
                                               "limits": {"cpu": "8", "memory": "32Gi"}},
            "runtime": {"env": [{"name": "A", "value": "1"},
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                        "envFrom": [{"configMapRef": {"name": "proxy"}}, {"secretRef": {"name": "creds"}, "prefix": "X_"}]}}
    d = b.deployment(spec, H, OWNER, replicas=2)
    tpl = d["spec"]["template"]
    pod = tpl["spec"]
    assert tpl["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert tpl["metadata"]["labels"]["team"] == "search" and tpl["metadata"]["labels"][c.LABEL_ENGINE_HASH] == H
    assert d["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    assert pod["affinity"] == POD["affinity"]
    assert pod["priorityClassName"] == "inference-high" and pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "registry-a"}, {"name": "registry-b"}]
    zone, host = pod["topologySpreadConstraints"]
    assert zone["labelSelector"] == {"matchLabels": b.selector_labels(OWNER)}  # defaults to this resource's pods
    assert host["labelSelector"] == {"matchLabels": {"team": "search"}}
    ctr = container(d)
    assert ctr["resources"] == {"requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
                                "limits": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}}
    env = {e["name"]: e for e in ctr["env"]}
    assert env["A"] == {"name": "A", "value": "1"}
    assert env["POD_IP"] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert env["TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "s", "key": "k"}}
    assert ctr["envFrom"] == spec["runtime"]["envFrom"]
    # nothing of it without spec.pod
    plain = b.deployment(SPEC, H, OWNER, replicas=2)["spec"]["template"]
    assert not {"affinity", "priorityClassName", "runtimeClassName", "imagePullSecrets",
                "topologySpreadConstraints"} & set(plain["spec"]) and "annotations" not in plain["metadata"]
    assert "envFrom" not in container(b.deployment(SPEC, H, OWNER, replicas=2))


def test_pod_overrides_that_apply_to_a_build_reach_the_build_pod():
    spec = {**SPEC, "pod": POD, "build": {**SPEC["build"], "resources": {"requests": {"cpu": "2", "memory": "8Gi"},
                                                                         "limits": {"memory": "12Gi"}}},
            "runtime": {"env": [{"name": "A", "value": "1"}]}}
    job = b.build_job(spec, H, OWNER)
    tpl = job["spec"]["template"]
    assert tpl["metadata"]["annotations"] == POD["annotations"] and tpl["metadata"]["labels"]["team"] == "search"
    assert tpl["metadata"]["labels"][c.LABEL_ENGINE_HASH] == H
    pod = tpl["spec"]
    assert pod["affinity"] == POD["affinity"] and pod["imagePullSecrets"] == [{"name": "registry-a"}, {"name": "registry-b"}]
    assert pod["priorityClassName"] == "inference-high" and pod["runtimeClassName"] == "nvidia"
    assert "topologySpreadConstraints" not in pod  # one pod: nothing to spread
    ctr = container(job)
    assert not any(e["name"] == "A" for e in ctr["env"])  # the serving container's environment only
    assert ctr["resources"]["requests"]["cpu"] == "2" and ctr["resources"]["limits"] == {"memory": "12Gi", "nvidia.com/gpu": "1"}


@pytest.mark.parametrize("pod, runtime, message", [
    ({"labels": {c.LABEL_ENGINE: "other"}}, {}, "pod.labels: kiln.dev/engine is set by Kiln"),
    ({"imagePullSecrets": [{}]}, {}, "pod.imagePullSecrets[0]: expected an object with a name"),
    ({"annotations": {"a": 1}}, {}, "pod.annotations.a: expected a string"),
    ({}, {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}, "not both"),
    ({}, {"envFrom": [{"prefix": "X"}]}, "runtime.envFrom[0]: expected a configMapRef or a secretRef"),
])
def test_pod_overrides_the_crd_cannot_check_are_refused_by_the_parser(pod, runtime, message):
    from kiln.operator.spec import EngineSpecError, parse_spec

    with pytest.raises(EngineSpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_spec({**SPEC, "pod": pod, "runtime": runtime})
