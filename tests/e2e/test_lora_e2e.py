"""LoRA adapters through the operator on the test plane: adapters from a Hub mirror
(``kiln.devcluster.hubserver``) are fetched onto the engine cache claim by Jobs and loaded into
the running pod, added and removed by editing ``spec.adapters`` while a client loop runs on the
base model: the pod is never restarted and never leaves Ready, no request fails, requests to an
added adapter are answered and to a removed one get 404.  An adapter of a larger rank than the
pods serve is ``Degraded`` / ``AdapterFailed`` (reason ``RankTooLarge``) while the base serves.
The pods require an API key (``runtime.apiKeySecretRef``): the operator calls them with it."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kiln.devcluster.hubserver import HubServer
from kiln.devcluster.load import ClientLoop, chat
from kiln.devcluster.lora_adapters import write_random_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(3600)]

NAME = "smollm2-lora"
KEY = "sk-kiln-e2e-lora"
# SmolLM2-135M's shapes (the embedded model's config.json), for the random adapters
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64}


def engine(adapters: list[dict]) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": NAME},
            "spec": {"model": {"builtin": "smollm2-135m-instruct"},
                     "build": {"quantization": "none", "maxSeqLen": 2048},  # the build is not what this tests
                     "runtime": {"maxNumSeqs": 8, "apiKeySecretRef": {"name": "kiln-api", "key": "key"},
                                 "lora": {"enabled": True, "maxLoras": 2}},
                     "resources": {"gpus": 0}, "replicas": 1, "adapters": adapters}}


def ready_pod(stack, ns) -> dict:
    pods = [p for p in stack.pods(ns, f"kiln.dev/engine={NAME},app.kubernetes.io/component=server")
            if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    p = pods[0]
    ready = next(c for c in p["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    restarts = sum(int(cs.get("restartCount") or 0) for cs in p["status"].get("containerStatuses") or [])
    return {"uid": p["metadata"]["uid"], "ready_since": ready["lastTransitionTime"], "restarts": restarts}


def test_adapters_added_and_removed_while_the_pod_stays_ready(stack, ns, measure, tmp_path):
    status = lambda: (stack.engine(NAME, ns) or {}).get("status") or {}  # noqa: E731
    states = lambda: {a["name"]: a for a in status().get("adapters") or []}  # noqa: E731
    with HubServer() as hub:
        for i, (repo, rank) in enumerate((("org/lora-a", 8), ("org/lora-b", 8), ("org/lora-r32", 32))):
            hub.add(repo, write_random_adapter(tmp_path / repo, SMOLLM2, rank=rank, seed=i), sha=f"{i + 1}" * 40)
        a, b, r32 = ({"name": n, "huggingFace": {"repo": f"org/{n}", "endpoint": hub.url}}
                     for n in ("lora-a", "lora-b", "lora-r32"))
        stack.kubectl("create", "secret", "generic", "kiln-api", "-n", ns, f"--from-literal=key={KEY}")
        stack.apply_obj(engine([a]), ns)
        stack.wait_ready(NAME, ns)
        stack.wait_for("lora-a loaded", lambda: states().get("lora-a", {}).get("state") == "Loaded", stall=180, ns=ns)
        before = ready_pod(stack, ns)
        proxy = stack.proxy(NAME, ns)
        proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))
        assert chat(proxy.url, "Hi", max_tokens=4, model="lora-a", api_key=KEY)

        loop = ClientLoop(proxy.url, model=NAME, max_tokens=4, api_key=KEY).start()
        try:
            t0 = time.monotonic()
            stack.apply_obj(engine([a, b]), ns)
            stack.wait_for("lora-b loaded", lambda: states().get("lora-b", {}).get("state") == "Loaded", stall=180,
                           ns=ns)
            measure("adapter added -> loaded in the running pod", time.monotonic() - t0)
            assert chat(proxy.url, "Hi", max_tokens=4, model="lora-b", api_key=KEY)

            t0 = time.monotonic()
            stack.apply_obj(engine([b]), ns)
            stack.wait_for("lora-a unloaded", lambda: [p.get("adapters") for p in status().get("pods") or []]
                           == [["lora-b"]], stall=120, ns=ns)
            measure("adapter removed -> unloaded", time.monotonic() - t0)
            with pytest.raises(httpx.HTTPStatusError) as e:
                chat(proxy.url, "Hi", max_tokens=4, model="lora-a", api_key=KEY)
            assert e.value.response.status_code == 404

            stack.apply_obj(engine([b, r32]), ns)  # rank 32 > runtime.lora.maxLoraRank 16
            stack.wait_for("AdapterFailed", lambda: status().get("phase") == "Degraded", stall=180, ns=ns)
            st = status()
            degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
            assert degraded["reason"] == "AdapterFailed" and "RankTooLarge" in degraded["message"], degraded
            assert (states()["lora-r32"]["state"], states()["lora-r32"]["reason"]) == ("Failed", "RankTooLarge")
            assert states()["lora-b"]["state"] == "Loaded"
            assert next(c for c in st["conditions"] if c["type"] == "Available")["status"] == "True"
            assert chat(proxy.url, "Hi", max_tokens=4, model=NAME, api_key=KEY)  # the base serves
            time.sleep(2)
        finally:
            loop.stop()
        after = ready_pod(stack, ns)
        measure("requests on the base during adapter changes", loop.num_ok + loop.num_failed, unit="requests",
                failed=loop.num_failed)
        assert after == before, (before, after)  # the same pod, never restarted, Ready throughout
        assert loop.num_ok > 0 and loop.num_failed == 0, loop.errors[:10]
        dep = json.loads(stack.kubectl("get", "deployment", NAME, "-n", ns, "-o", "json"))
        assert int(dep["metadata"]["generation"]) == 1  # the adapter list never touched the Deployment
