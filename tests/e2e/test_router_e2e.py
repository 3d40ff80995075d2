"""Scale to zero through the chart's router, end to end: an InferenceEngine with
``autoscaling.minReplicas: 0`` serves a request through the router (`kiln router`, the chart's
router pod on the process node), goes to 0 replicas when idle; a request sent then is held by
the router, the engine scales 0 -> 1, and the request is answered. Nothing fails.  Before that,
a second InferenceEngine behind the same router: `/v1/models` lists both, each request reaches
its own engine's pod.

    .venv/bin/python -m pytest -m e2e tests/e2e/test_router_e2e.py -s   # ~3 min on 2 cores

Measured (printed, appended to <plane>/e2e-measurements.jsonl): cold start 0 -> first token
through the router.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"
IDLE_SECONDS = 20


def engine(name: str) -> dict:
    ie = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    ie["metadata"]["name"] = name
    ie["spec"]["build"] = {"quantization": "none", "maxSeqLen": 2048}  # the quickest build
    ie["spec"]["autoscaling"] = {"mode": "builtin", "minReplicas": 0, "maxReplicas": 1,
                                 "scaleToZeroAfterSeconds": IDLE_SECONDS}
    return ie


def listed(router_url: str, model: str) -> dict | None:
    data = httpx.get(f"{router_url}/v1/models", timeout=10).json()["data"]
    return next((m for m in data if m["id"] == model), None)


def stream_chat(url: str, model: str) -> tuple[float, str, int]:
    """A streamed chat completion: (seconds to the first content token, the text, HTTP status)."""
    t0 = time.monotonic()
    first, text = None, []
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return 0.0, r.read().decode(), r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content")
            if delta:
                first = first or time.monotonic() - t0
                text.append(delta)
    return first or 0.0, "".join(text), r.status_code


def finished(pod: dict) -> dict[str, float]:
    """``kiln_request_success_total`` of a serving pod's own ``/metrics``, by ``model_name``."""
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'kiln_request_success_total\{[^}]*model_name="([^"]+)"[^}]*\} (\S+)', line)
        if m:
            out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def test_idle_engine_scales_to_zero_and_a_held_request_wakes_it(stack, ns, measure):
    """Also two engines behind the one router: "zero" and "steady" (another InferenceEngine,
    served under its own model name; the same build spec, so one build Job) are both listed by
    `/v1/models`, and each request reaches only its own engine's pod (the pods' own counters)."""
    from openai import OpenAI
    name, other = "zero", "steady"
    ie = engine(name)
    steady = engine(other)
    steady["spec"].pop("autoscaling")
    steady["spec"]["replicas"] = 1
    stack.apply_obj(ie, ns)
    stack.apply_obj(steady, ns)
    stack.wait_ready(name, ns)
    stack.wait_ready(other, ns)
    router = stack.proxy("kiln-router", "kiln-system")
    router.wait_endpoints(1)
    for model in (name, other):
        stack.wait_for(f"the router sees a ready replica of {model}",
                       lambda: (listed(router.url, model) or {}).get("ready_replicas") == 1, stall=60)
    _, text, status = stream_chat(router.url, name)
    assert status == 200 and "paris" in text.lower(), text

    # --- many models behind one address: /v1/models lists both; each request goes to its engine's pod
    client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=300)
    assert {name, other} <= {m.id for m in client.models.list().data}
    pods = {model: next(p for p in stack.pods(ns, f"kiln.dev/engine={model},app.kubernetes.io/component=server")
                        if p["status"].get("podIP")) for model in (name, other)}
    before = {model: finished(pod) for model, pod in pods.items()}
    sent = {name: 2, other: 1}
    for model, n in sent.items():
        for _ in range(n):
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=4, temperature=0)
            assert r.model == model, r
    for model, pod in pods.items():
        after = finished(pod)
        assert set(after) == {model}, after  # the pod serves only its own model name
        assert after[model] - before[model].get(model, 0.0) == sent[model], (model, before[model], after)
    stack.kubectl("delete", "inferenceengine", other, "-n", ns, "--wait=false")  # the CPU back for the rest

    def replicas() -> tuple[int, int]:
        d = json.loads(stack.kubectl("get", "deployment", name, "-n", ns, "-o", "json"))
        return int(d["spec"].get("replicas") or 0), int((d.get("status") or {}).get("readyReplicas") or 0)

    stack.wait_for("the idle engine at 0 replicas", lambda: replicas() == (0, 0) and not stack.pods(ns,
                   f"kiln.dev/engine={name},app.kubernetes.io/component=server"), stall=IDLE_SECONDS + 90, ns=ns)
    st = stack.engine(name, ns)["status"]
    available = next(x for x in st["conditions"] if x["type"] == "Available")
    assert st["phase"] == "Ready" and available["reason"] == "ScaledToZero", st
    assert listed(router.url, name)["ready_replicas"] == 0  # still listed while at zero

    out: dict = {}
    t0 = time.monotonic()
    sender = threading.Thread(target=lambda: out.update(zip(("ttft", "text", "status"), stream_chat(router.url, name))))
    sender.start()
    stack.wait_for("the engine scaled 0 -> 1", lambda: replicas()[0] == 1, stall=60, ns=ns)
    assert sender.is_alive() or out.get("status") == 200  # held, not refused
    sender.join(600)
    assert out["status"] == 200 and "paris" in out["text"].lower(), out
    measure("cold start 0 -> first token through the router", out["ttft"], idle_window_s=IDLE_SECONDS,
            wall_s=round(time.monotonic() - t0, 2))
    annotations = stack.engine(name, ns)["metadata"].get("annotations") or {}
    assert "kiln.dev/last-request-time" in annotations  # the router's signal the operator followed
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    failed = [line for line in metrics.splitlines() if line.startswith("kiln_router_requests_total{")
              and f'engine="{name}"' in line and 'code="200"' not in line and not line.endswith(" 0.0")]
    assert not failed, failed
