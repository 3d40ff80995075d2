"""Load: 200 concurrent streamed requests with random lengths and random client disconnects.
Afterwards nothing is running or waiting, no KV block is held, and the metrics agree with
what was sent."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from kiln_server import start_server, stop_server

pytestmark = pytest.mark.slow

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, i: int) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    max_tokens = rng.randint(1, 24)
    disconnect_after = rng.choice([None, None, None, 0, 1, 3])  # chunks, then hang up
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]),
            "stream": True, "stream_options": {"include_usage": True}, "seed": i}
    res = {"status": None, "completion_tokens": 0, "disconnected": False, "finish": None}
    async with client.stream("POST", url, json=body) as r:
        res["status"] = r.status_code
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if disconnect_after is not None and n >= disconnect_after:
                res["disconnected"] = True
                break
            n += 1
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                res["completion_tokens"] = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c.get("finish_reason"):
                    res["finish"] = c["finish_reason"]
    return res


async def _bad(client: httpx.AsyncClient, url: str) -> int:
    r = await client.post(url, json={"prompt": "x", "max_tokens": -1, "stream": True})
    return r.status_code


def test_200_concurrent_streams_with_disconnects():
    server = start_server("--max-num-seqs", "64", "--max-model-len", "1024", "--num-kv-blocks", "400")
    try:
        url = f"{server.v1}/completions"
        rng = random.Random(7)
        base_success = server.metric("kiln_request_success_total")  # the warm-up request
        base_gen = server.metric("kiln_generation_tokens_total")

        async def main():
            limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                good = [_one(client, url, random.Random(rng.random()), i) for i in range(200)]
                bad = [_bad(client, url) for _ in range(10)]
                return await asyncio.gather(*good), await asyncio.gather(*bad)

        results, bad = asyncio.run(main())
        assert all(s == 400 for s in bad)
        assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
        completed = [r for r in results if not r["disconnected"]]
        assert 50 < len(completed) < 200

        # The engine drains aborted requests between steps: wait for the gauges to settle.
        import time
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (server.metric("kiln_num_requests_running") == 0 and server.metric("kiln_num_requests_waiting") == 0
                    and server.metric("kiln_request_success_total") >= base_success + 200):
                break
            time.sleep(0.5)
        assert server.metric("kiln_num_requests_running") == 0
        assert server.metric("kiln_num_requests_waiting") == 0
        assert server.metric("kiln_kv_cache_usage_ratio") == 0.0  # no block held by any request
        # Every accepted request finished exactly once (stop, length or abort); 400s never count.
        assert server.metric("kiln_request_success_total") == base_success + 200
        done_ok = server.metric("kiln_request_success_total", finished_reason="length") + \
            server.metric("kiln_request_success_total", finished_reason="stop")
        assert done_ok >= len(completed)
        assert server.metric("kiln_generation_tokens_total") - base_gen >= sum(r["completion_tokens"] for r in completed)
        assert server.metric("kiln_request_queue_time_seconds_count") >= len(completed)
        # The server still answers.
        r = httpx.post(url, json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200
    finally:
        stop_server(server)


def test_api_key_and_served_model_name():
    server = start_server("--max-num-seqs", "4", "--served-model-name", "team-llm", api_key="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    try:
        # --served-model-name replaces the source's name (as in vLLM): only it is listed and accepted
        models = httpx.get(f"{server.v1}/models", headers=auth, timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["team-llm"]
        r = httpx.post(f"{server.v1}/completions", json={"prompt": "Hi", "max_tokens": 1, "model": "team-llm"},
                       headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "team-llm", r.text
        r = httpx.post(f"{server.v1}/completions", headers=auth, timeout=60,
                       json={"prompt": "Hi", "max_tokens": 1, "model": "builtin:smollm2-135m-instruct"})  # the source
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert "team-llm" in r.json()["error"]["message"]
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.post(f"{server.v1}/completions", json=body).status_code == 401
        r = httpx.post(f"{server.v1}/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{server.v1}/completions", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert r.status_code == 200
        assert httpx.get(f"{server.base}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{server.base}/metrics").status_code == 200
        # SIGTERM (a pod stopping) lets a running stream finish: every token, then [DONE], exit 0
        stream = {"prompt": "Count slowly:", "max_tokens": 40, "ignore_eos": True, "stream": True,
                  "model": "team-llm"}
        chunks = []
        with httpx.stream("POST", f"{server.v1}/completions", json=stream, headers=auth, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    if len(chunks) == 1:
                        server.proc.terminate()
        assert chunks[-1] == "[DONE]", chunks[-3:]
        finishes = [json.loads(c)["choices"][0].get("finish_reason") for c in chunks[:-1]]
        assert finishes[-1] == "length", finishes[-3:]
        assert server.proc.wait(timeout=60) in (0, -15)  # uvicorn re-raises SIGTERM once it has drained
    finally:
        stop_server(server)


def test_shutdown_timeout_bounds_the_drain():
    """``--shutdown-timeout``: after SIGTERM, a stream that outlasts it is cut off (no [DONE])
    and the process exits; the default (45 s) lets streams finish (test above)."""
    server = start_server("--max-num-seqs", "2", "--shutdown-timeout", "0.5", "--max-model-len", "2048")
    try:
        body = {"prompt": "Count slowly:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        chunks = []
        try:
            with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        if len(chunks) == 1:
                            server.proc.terminate()
        except httpx.HTTPError:
            pass  # the server closed the connection mid-stream
        assert chunks and chunks[-1] != "[DONE]" and len(chunks) < 1500, (len(chunks), chunks[-1:])
        assert server.proc.wait(timeout=60) in (0, -15)
    finally:
        stop_server(server)
