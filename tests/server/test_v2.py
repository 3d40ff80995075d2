"""Triton / KServe v2 endpoints: health and metadata through the official ``tritonclient``
HTTP client, the generate extension through httpx, bad input refused in Triton's error body."""

from __future__ import annotations

import json

import httpx
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

MODEL = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tclient(server):
    c = triton.InferenceServerClient(url=server.base.split("//", 1)[1])
    yield c
    c.close()


def test_health_and_metadata_with_tritonclient(tclient):
    assert tclient.is_server_live() and tclient.is_server_ready()
    assert tclient.is_model_ready(MODEL)
    assert not tclient.is_model_ready("no-such-model")
    meta = tclient.get_server_metadata()
    assert meta["name"] == "kiln" and "generate" in meta["extensions"]
    model = tclient.get_model_metadata(MODEL)
    assert model["name"] == MODEL and model["versions"] == ["1"]
    assert [i["name"] for i in model["inputs"]][0] == "text_input"
    with pytest.raises(InferenceServerException, match="unknown model"):
        tclient.get_model_metadata("no-such-model")


def test_generate_matches_completions(server):
    body = {"text_input": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.base}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model_name"] == MODEL and out["num_output_tokens"] == 8
    ref = httpx.post(f"{server.v1}/completions", timeout=120,
                     json={"prompt": body["text_input"], "max_tokens": 8, "temperature": 0}).json()
    assert out["text_output"] == ref["choices"][0]["text"]


def test_generate_stream_sends_deltas(server):
    body = {"text_input": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "parameters": {"ignore_eos": True}}
    chunks = []
    with httpx.stream("POST", f"{server.base}/v2/models/{MODEL}/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert len(chunks) >= 4 and chunks[-1]["finish_reason"] == "length"
    full = httpx.post(f"{server.base}/v2/models/{MODEL}/generate", json=body, timeout=120).json()["text_output"]
    assert "".join(c["text_output"] for c in chunks) == full


@pytest.mark.parametrize("path,body,status,needle", [
    ("generate", {"max_tokens": 4}, 400, "text_input"),
    ("generate", {"text_input": "hi", "max_tokens": -2}, 400, "max_tokens"),
    ("generate", {"text_input": "hi", "temprature": 0.5}, 400, "temprature"),
    ("generate", {"text_input": "hi", "stream": True}, 400, "generate_stream"),
    ("generate_stream", {"text_input": "hi", "max_tokens": 100000}, 400, "maximum context length"),
    ("generate", {"text_input": "hi", "top_p": 0}, 400, "top_p"),
])
def test_generate_refuses_bad_input(server, path, body, status, needle):
    r = httpx.post(f"{server.base}/v2/models/{MODEL}/{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]


def test_generate_unknown_model_and_malformed_json(server):
    r = httpx.post(f"{server.base}/v2/models/nope/generate", json={"text_input": "hi"}, timeout=60)
    assert r.status_code == 404 and "unknown model" in r.json()["error"]
    r = httpx.post(f"{server.base}/v2/models/{MODEL}/generate", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
