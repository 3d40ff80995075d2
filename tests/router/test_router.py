"""`kiln router` against real `kiln serve` replicas (the embedded default model): the OpenAI
client and the v2 API through it, streaming passthrough, replica choice per policy, client
disconnects, the hold queue (an engine with no ready replica, then one), refused connections.

    .venv/bin/python -m pytest -q tests/router/test_router.py   # two kiln serve processes, ~1-2 min on 2 cores
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from router_testutil import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def wait_until(what, fn, stall=60.0):
    """Poll ``fn`` until true; fail when it stays false ``stall`` seconds (a hang guard)."""
    end = time.monotonic() + stall
    while not fn():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def router_metric(router, name, **labels) -> float:
    text = httpx.get(f"{router.base}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, val = line.rpartition(" ")
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += float(val)
    return total


def served(server) -> float:
    return server.metric("kiln_request_success_total")


def backends(upstreams):
    return {MODEL: tuple(s.base for s in upstreams)}


def test_openai_client_through_the_router(upstreams, make_router):
    router = make_router(backends=backends(upstreams), policy="least-outstanding")
    direct = openai.OpenAI(base_url=upstreams[0].v1, api_key="x")
    via = openai.OpenAI(base_url=f"{router.base}/v1", api_key="x")
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    want = direct.chat.completions.create(**kw).choices[0].message.content
    assert via.chat.completions.create(**kw).choices[0].message.content == want
    chunks = list(via.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    with httpx.stream("POST", f"{router.base}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Paris is", "max_tokens": 4, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    models = via.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert router_metric(router, "kiln_router_requests_total", model=MODEL, code="200") == 3
    assert router_metric(router, "kiln_router_queue_requests", model=MODEL) == 0


def test_v2_generate_and_errors(upstreams, make_router):
    router = make_router(backends=backends(upstreams))
    body = {"text_input": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{router.base}/v2/models/{MODEL}/generate", json=body, timeout=120)
    ref = httpx.post(f"{upstreams[1].base}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["text_output"] == ref.json()["text_output"]
    assert httpx.get(f"{router.base}/v2/models/{MODEL}/ready", timeout=30).status_code == 200
    r = httpx.post(f"{router.base}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{router.base}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    r = httpx.post(f"{router.base}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{router.base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -3}, timeout=30)
    assert r.status_code == 400  # the engine's own answer passes through
    assert httpx.get(f"{router.base}/ready", timeout=10).status_code == 200


@pytest.mark.parametrize("policy", ["prefix", "round-robin"])
def test_policy_decides_the_replica(upstreams, make_router, policy):
    router = make_router(backends=backends(upstreams), policy=policy, prefix_chars=40)
    before = [served(s) for s in upstreams]
    for i in range(6):
        r = httpx.post(f"{router.base}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "You are a terse assistant. Answer in one word. " + f"Question {i}?",
            "max_tokens": 2})
        assert r.status_code == 200, r.text
    moved = sorted(served(s) - b for s, b in zip(upstreams, before))
    assert moved == ([0, 6] if policy == "prefix" else [3, 3])  # one prefix: one replica; else in turn


def test_client_disconnect_mid_stream_aborts_upstream(upstreams, make_router):
    router = make_router(backends={MODEL: (upstreams[0].base,)})
    aborted = upstreams[0].metric("kiln_request_success_total", finished_reason="abort")
    with httpx.stream("POST", f"{router.base}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token came through: hang up
    wait_until("the upstream abort",
               lambda: upstreams[0].metric("kiln_request_success_total", finished_reason="abort") >= aborted + 1)
    wait_until("no request running upstream", lambda: upstreams[0].metric("kiln_num_requests_running") == 0)
    wait_until("the router's queue empty", lambda: router_metric(router, "kiln_router_queue_requests") == 0)


def test_client_timeout_before_the_answer_aborts_upstream(upstreams, make_router):
    """A non-streamed request sends nothing until it is done: a client that gives up first still
    closes the upstream request."""
    router = make_router(backends={MODEL: (upstreams[1].base,)})
    aborted = upstreams[1].metric("kiln_request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.base}/v1/completions", timeout=3, json={
            "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True})
    wait_until("the upstream abort",
               lambda: upstreams[1].metric("kiln_request_success_total", finished_reason="abort") >= aborted + 1)
    wait_until("no request running upstream", lambda: upstreams[1].metric("kiln_num_requests_running") == 0)
    wait_until("the router's queue empty", lambda: router_metric(router, "kiln_router_queue_requests") == 0)


def ie(name="eng", served_name=MODEL, min_replicas=0):
    scaling = {"mode": "builtin", "minReplicas": 0, "scaleToZeroAfterSeconds": 60} if min_replicas == 0 else {}
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine",
            "metadata": {"name": name, "namespace": "ns", "uid": "u1", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"model": {"builtin": "smollm2-135m-instruct", "servedModelName": served_name},
                     "autoscaling": scaling}}


def endpoint_slice(service, base, ready=True):
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return {"metadata": {"name": f"{service}-abc", "namespace": "ns",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
            "endpoints": [{"addresses": [host], "conditions": {"ready": ready}}]}


def test_a_request_waits_for_a_ready_replica_then_is_answered(upstreams, make_router):
    router = make_router(hold_timeout_seconds=120)
    router.call(lambda: router.state.table.set_engine(ie()))
    assert httpx.get(f"{router.base}/v1/models", timeout=10).json()["data"][0]["ready_replicas"] == 0
    out = {}

    def send():
        out["r"] = httpx.post(f"{router.base}/v1/chat/completions", timeout=180,
                              json={"model": MODEL, "messages": CHAT, "max_tokens": 4})

    t = threading.Thread(target=send)
    t.start()
    wait_until("the request held", lambda: router_metric(router, "kiln_router_requests_held", model=MODEL) == 1)
    router.call(lambda: router.state.table.set_slice(endpoint_slice("eng", upstreams[0].base, ready=False)))
    assert router_metric(router, "kiln_router_requests_held", model=MODEL) == 1  # not ready: still held
    router.call(lambda: router.state.table.set_slice(endpoint_slice("eng", upstreams[0].base)))
    t.join(180)
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["message"]["content"]
    assert router_metric(router, "kiln_router_requests_held") == 0
    assert router_metric(router, "kiln_router_hold_seconds_count", model=MODEL) == 1


def test_hold_timeout_queue_bound_and_disconnect_while_held(make_router):
    router = make_router(hold_timeout_seconds=1, max_held_requests=1)
    router.call(lambda: router.state.table.set_engine(ie()))
    r = httpx.post(f"{router.base}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_replica"
    assert "kubectl describe ie eng -n ns" in r.json()["error"]["message"]

    slow = make_router(hold_timeout_seconds=120, max_held_requests=1)
    slow.call(lambda: slow.state.table.set_engine(ie()))
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up while held
        httpx.post(f"{slow.base}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=2)
    wait_until("the held request dropped", lambda: router_metric(slow, "kiln_router_requests_held") == 0)
    t = threading.Thread(target=lambda: httpx.post(f"{slow.base}/v1/completions", timeout=10,
                                                   json={"model": MODEL, "prompt": "x"}))
    t.start()
    wait_until("one request held", lambda: router_metric(slow, "kiln_router_requests_held") == 1)
    r = httpx.post(f"{slow.base}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_held"
    slow.call(lambda: slow.state.table.drop_engine("ns", "eng"))  # the held one: the engine went away
    t.join(30)
    assert router_metric(slow, "kiln_router_requests_total", code="404") == 1


def test_a_refused_connection_is_retried_on_another_replica(upstreams, make_router):
    from kiln.runtime.demo import free_port
    dead = f"http://127.0.0.1:{free_port()}"
    router = make_router(backends={MODEL: (dead, upstreams[0].base)}, policy="round-robin")
    for _ in range(4):
        r = httpx.post(f"{router.base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 200
    assert router_metric(router, "kiln_router_upstream_retries_total") >= 1
    only_dead = make_router(backends={MODEL: (dead,)})
    r = httpx.post(f"{only_dead.base}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"


def test_unknown_paths_and_methods_answer_in_the_error_shape(make_router):
    router = make_router(backends={MODEL: ("http://127.0.0.1:9",)})
    r = httpx.get(f"{router.base}/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "GET" in r.json()["error"]["message"]
    r = httpx.get(f"{router.base}/nothing/here", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "/nothing/here" in r.json()["error"]["message"]


def test_an_upstream_that_never_answers_is_a_504_naming_the_timeout(make_router):
    import socket
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never answers
    try:
        router = make_router(backends={MODEL: (f"http://127.0.0.1:{silent.getsockname()[1]}",)},
                             upstream_timeout_seconds=0.5)
        r = httpx.post(f"{router.base}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert "--upstream-timeout-seconds" in r.json()["error"]["message"]
        assert router_metric(router, "kiln_router_requests_total", code="504") == 1
    finally:
        silent.close()
