"""The server through the official `openai` client: chat and completions, streaming and not,
n > 1, logprobs, stop strings, seeds, and the OpenAI-style 400s for bad input."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def test_models_health_ready(server, client):
    models = client.models.list().data
    assert models and models[0].id == "builtin:smollm2-135m-instruct"
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert httpx.get(f"{server.base}/ready").json()["status"] == "ready"
    for path in ("/health", "/ready"):  # HEAD answers as GET, without a body
        r = httpx.head(f"{server.base}{path}")
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model="builtin:smollm2-135m-instruct", temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens == r.usage.total_tokens - r.usage.prompt_tokens


def test_chat_streaming_matches_non_streaming(client):
    kw = dict(model="builtin:smollm2-135m-instruct", temperature=0, max_tokens=40,
              messages=[{"role": "user", "content": "Name three colors."}])
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_stream_and_done_marker(server):
    with httpx.stream("POST", f"{server.v1}/completions", timeout=60, json={
        "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    body = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "Paris" in "".join(b["choices"][0]["text"] for b in body)


def test_n_logprobs_seed(client):
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="Once upon a time", max_tokens=12,
              temperature=1.0, n=3, seed=1234, logprobs=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # n > 1: distinct samples
    lp = a.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) > 0
    assert all(v <= 0.0 for v in lp.token_logprobs)
    assert all(len(t) <= 4 for t in lp.top_logprobs)  # the top 3 and the sampled token
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == logprob  # sampled at temperature 1: listed even outside the top 3


def test_seeds_differing_in_high_bits_give_different_samples(client):
    """torch's CPU generator keeps 32 bits of a seed: the engine mixes all 64 first."""
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="Once upon a time", max_tokens=16, temperature=1.0)
    texts = [client.completions.create(seed=sd, **kw).choices[0].text
             for sd in (-1, 2**63 - 1, 0, 2**32, -2**63, 1, 2**32 + 1)]
    assert len(set(texts)) == len(texts), texts


def test_stop_string_not_leaked(client, server):
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="1, 2, 3, 4, 5, 6,", max_tokens=30, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert " 8," in free
    stopped = client.completions.create(stop=[" 8,"], **kw).choices[0]
    assert stopped.finish_reason == "stop" and " 8," not in stopped.text
    assert free.startswith(stopped.text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=[" 8,"], **kw))
    assert streamed == stopped.text


BAD = [
    ({"prompt": "", "max_tokens": 4}, "empty"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "-3"),
    ({"prompt": "hi", "max_tokens": 100000}, "100000"),
    ({"prompt": "hi " * 3000, "max_tokens": 4}, "2048"),
    ({"prompt": "hi", "n": 500}, "500"),
    ({"prompt": "hi", "temperature": -1}, "-1"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "1.5"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "2"}, "valid integer"),  # strict JSON types, as OpenAI's API
    ({"prompt": "hi", "max_tokens": 2.5}, "valid integer"),
    ({"prompt": "hi", "temperature": "0.5"}, "valid number"),
    ({"prompt": "hi", "n": True}, "valid integer"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": "hi", "temperature": float("nan")}, "finite"),
    ({"prompt": "hi", "temperature": float("inf")}, "finite"),
    ({"prompt": "hi", "stop_token_ids": [-5]}, "-5"),
    ({"prompt": "hi", "stop_token_ids": [10**9]}, "1000000000"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 300}}, "[-100, 100]"),
    ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "99999999"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "hi", "seed": 2**64}, "64-bit"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens must be at least 1"),
    ({"prompt": "hi", "include_stop_str_in_output": True, "stop": "."}, "include_stop_str_in_output: not supported"),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options applies only with stream: true"),
    ({"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": "required"}, "tool calling is served on /v1/chat/completions"),
]


@pytest.mark.parametrize("body,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_gets_400(server, body, needle):
    r = httpx.post(f"{server.v1}/completions", content=json.dumps(body).encode(),  # json.dumps writes NaN
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("message,needle", [
    ({"role": "user"}, "needs a content"),
    ({"role": "user", "content": None}, "needs a content"),
    ({"role": "user", "content": [{"type": "text"}]}, '"text" field'),
])
def test_chat_message_without_content_gets_400(server, message, needle):
    r = httpx.post(f"{server.v1}/chat/completions", json={"messages": [message], "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize("extra,needle", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "has no parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]},
     'invalid JSON schema: Unsupported type "foo"'),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "get weather", "parameters": {}}}]},
     "must be 1 to 64 letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}},
                {"type": "function", "function": {"name": "f", "parameters": {}}}]}, "two tools are named 'f'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5,
                                                                              "maximum": 1}}}},
     "minimum greater than maximum"),
    ({"guided_regex": "a("}, "invalid regex"),
    ({"guided_grammar": "root ::= \"a"}, "invalid EBNF grammar"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "give one output constraint"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"min_tokens": 9, "max_completion_tokens": 3}, "max_completion_tokens (3)"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs must be between 0 and 20"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output: not supported"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message, add_generation_prompt"),
    ({"chat_template": "{{ raise_exception('x') }}"}, "chat_template: not supported"),
    ({"echo": True}, "echo: not supported"),
])
def test_chat_features_not_served_get_400(server, extra, needle):
    r = httpx.post(f"{server.v1}/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(f"{server.v1}/chat/completions", timeout=60,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [],
                          "tool_choice": "none", "response_format": {"type": "text"},
                          # vLLM extensions at their no-op values, and a field of no known meaning
                          "include_stop_str_in_output": False, "add_generation_prompt": True, "echo": False,
                          "some_client_field": 1})
    assert ok.status_code == 200, ok.text


def test_min_tokens_over_http(server):
    r = httpx.post(f"{server.v1}/completions", json={"prompt": "The capital of France is", "max_tokens": 12,
                                                     "min_tokens": 12, "temperature": 0, "stop": ["."]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12 and r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{server.v1}/completions", json={"prompt": "Hi", "max_tokens": 2, "min_tokens": None}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.v1}/chat/completions", timeout=60,  # no max_tokens: what is left of the context
                   json={"messages": [{"role": "user", "content": "Hi"}], "min_tokens": 10**6})
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"], r.text


def test_prompt_list_is_one_batch(server):
    """A list of prompts runs as concurrent requests (each choice complete, one per prompt),
    and a bad prompt in the list fails the whole request without leaving any running."""
    r = httpx.post(f"{server.v1}/completions", json={"prompt": ["Hello"] * 6, "max_tokens": 3,
                                                     "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert len(texts) == 6 and len(set(texts)) == 1
    r = httpx.post(f"{server.v1}/completions", json={"prompt": ["Hello", [10**9]], "max_tokens": 3}, timeout=60)
    assert r.status_code == 400, r.text


def test_malformed_json_gets_400(server):
    r = httpx.post(f"{server.v1}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.v1}/chat/completions", json={"messages": "hello"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    for body, name in ((None, "null"), ([1], "an array"), ("x", "a string"), (3, "a number")):
        r = httpx.post(f"{server.v1}/chat/completions", content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].endswith(f"JSON object, got {name}"), r.text
    # a form-encoded body (curl -d without a content type) is told what to send
    r = httpx.post(f"{server.v1}/chat/completions", content=b"{not json",
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "send application/json" in r.json()["error"]["message"]


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="builtin:smollm2-135m-instruct", max_tokens=4, temperature=-2,
                                       messages=[{"role": "user", "content": "hi"}])
    # ... and the server still serves everyone else.
    r = client.chat.completions.create(model="builtin:smollm2-135m-instruct", max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content


def test_invalid_unicode_and_deep_nesting_get_400(server):
    r = httpx.post(f"{server.v1}/completions", content=b'{"prompt": "hi \\ud800 there", "max_tokens": 2}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"]
    deep = b'{"prompt": "hi", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    r = httpx.post(f"{server.v1}/completions", content=deep, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


def test_non_streaming_disconnect_aborts(server):
    import time

    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.v1}/completions", json={"prompt": [1, 2, 3], "max_tokens": 1500, "ignore_eos": True},
                   timeout=3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metric("kiln_num_requests_running") > 0:
        time.sleep(0.5)
    assert server.metric("kiln_num_requests_running") == 0
    assert server.metric("kiln_kv_cache_usage_ratio") == 0.0


def test_streamed_logprobs_cover_every_token(client):
    """Tokens that add no text yet (parts of an emoji / CJK character, text held back by a
    stop string) still stream their logprobs: streaming returns as many as non-streaming."""
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="Emoji list: 😀😃😄😁 日本語のテキスト:",
              max_tokens=24, temperature=0, logprobs=1, stop=["Paris"])
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert len(streamed) == len(full.logprobs.tokens) > 0
    assert "".join(c.choices[0].text for c in chunks) == full.text


@pytest.mark.parametrize("path,body", [
    ("completions", {"prompt": "hi", "model": "gpt-4", "max_tokens": 1}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4", "max_tokens": 1}),
])
def test_unknown_model_is_404(server, path, body):
    r = httpx.post(f"{server.v1}/{path}", json=body, timeout=30)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]


def test_body_cut_off_by_the_client_logs_no_traceback(server):
    """A client that closes the connection in the middle of its request body."""
    import socket

    host, port = server.base.split("//")[1].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hi\"")
    time.sleep(1.0)
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert "ClientDisconnect" not in server.log_text()


def test_lone_surrogate_and_huge_prompt_get_400_quickly(server):
    """Invalid Unicode gets a plain message; a prompt far past the context is refused without
    tokenizing it (tokenizing 9 MB takes seconds; it also runs off the event loop now)."""
    for path, body in (("completions", {"prompt": "\ud800abc", "max_tokens": 1}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "x\udfffy"}], "max_tokens": 1})):
        r = httpx.post(f"{server.v1}/{path}", content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
    huge = "hi " * 3_000_000
    for path, body in (("completions", {"prompt": huge, "max_tokens": 1}),
                       ("chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 1})):
        r = httpx.post(f"{server.v1}/{path}", json=body, timeout=60)
        msg = r.json()["error"]["message"]
        # refused by the length bound ("characters"), not after tokenizing ("tokens")
        assert r.status_code == 400 and "maximum context length" in msg and "9000000 characters" in msg, r.text


def test_completion_text_offset(client):
    """text_offset[i] is where token i's text starts in the choice's text, the same streamed
    and not (echo with logprobs would need prompt logprobs: a 400)."""
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="The capital of France is", max_tokens=10,
              temperature=0, logprobs=1)
    full = client.completions.create(**kw).choices[0]
    lp = full.logprobs
    assert lp.text_offset[0] == 0 and len(lp.text_offset) == len(lp.tokens)
    for i in range(1, len(lp.tokens)):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    assert "".join(lp.tokens) == full.text  # plain ASCII text: tokens spell it
    streamed = [o for c in client.completions.create(stream=True, **kw)
                for o in (c.choices[0].logprobs.text_offset if c.choices[0].logprobs else [])]
    assert streamed == lp.text_offset
    # a stop string of several tokens: its tokens stay in logprobs, their offsets at the text's end
    kw2 = dict(kw, prompt="The cat sat on the", max_tokens=20)
    free = client.completions.create(**kw2).choices[0]
    stop = free.text[3:12]
    cut = client.completions.create(stop=[stop], **kw2).choices[0]
    assert cut.finish_reason == "stop" and len(cut.text) <= 3
    assert all(o <= len(cut.text) for o in cut.logprobs.text_offset), (cut.text, cut.logprobs.text_offset)


def _raw(token: str) -> bytes:
    """A completions logprobs token back to its bytes (OpenAI's ``bytes:\\xNN`` form or text)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[6:].split("\\x")[1:])
    return token.encode()


def test_logprobs_of_split_characters(client):
    """Byte-level tokens that are fragments of an emoji: their own bytes (not U+FFFD), distinct
    top_logprobs keys, offsets inside the text; chat's ``bytes`` are the real bytes too."""
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="Here are some emojis: \U0001F389\U0001F525",
              max_tokens=12, temperature=0, logprobs=2)
    c = client.completions.create(**kw).choices[0]
    lp = c.logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens), lp.tokens  # the model emits emoji fragments
    raw = b"".join(_raw(t) for t in lp.tokens)
    assert raw.startswith(c.text.encode()) and len(raw) - len(c.text.encode()) < 4
    assert lp.text_offset == sorted(lp.text_offset) and all(0 <= o <= len(c.text) for o in lp.text_offset)
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and abs(top[tok] - logprob) < 1e-4  # greedy: the chosen token is in its top 2
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    chat = client.chat.completions.create(
        model="builtin:smollm2-135m-instruct", temperature=0, max_tokens=8, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "Reply with only the fire emoji \U0001F525"}]).choices[0]
    content = chat.logprobs.content
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.startswith(chat.message.content.encode())
    assert any(e.token == "\ufffd" and bytes(e.bytes) != "\ufffd".encode() for e in content), content


def test_stream_n_sends_one_finish_per_choice(client):
    for stream_chat in (False, True):
        if stream_chat:
            chunks = list(client.chat.completions.create(
                model="builtin:smollm2-135m-instruct", n=4, seed=0, temperature=1.0, max_tokens=30, stop=["\n", "."],
                stream=True, messages=[{"role": "user", "content": "Say yes or no."}]))
        else:
            chunks = list(client.completions.create(
                model="builtin:smollm2-135m-instruct", prompt="Q: Say yes or no.\nA:", n=4, seed=0, temperature=1.0,
                max_tokens=30, stop=["\n"], stream=True))
        finals = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
        assert sorted(finals) == [0, 1, 2, 3], (stream_chat, finals)


def test_tiny_temperature_is_greedy(client):
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="The capital of France is", max_tokens=6)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    assert client.completions.create(temperature=1e-40, **kw).choices[0].text == greedy


def test_logit_bias_steers_sampling(client):
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="The capital of France is", max_tokens=5, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    biased = client.completions.create(logit_bias={"45": 100}, **kw).choices[0].text  # 45 is "="
    assert plain.startswith(" Paris") and biased == "=" * 5


def test_echo_prepends_the_prompt(client, server):
    kw = dict(model="builtin:smollm2-135m-instruct", prompt="The capital of France is", max_tokens=4, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(echo=True, **kw).choices[0].text
    assert echoed == kw["prompt"] + plain
    chunks = list(client.completions.create(echo=True, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == echoed


def _openai_error(r: httpx.Response) -> dict:
    """The error object of an OpenAI-style error response (and nothing but it: no FastAPI
    ``detail``)."""
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


@pytest.mark.parametrize("method,path", [("POST", "/v1/foo"), ("GET", "/nothing/here"), ("POST", "/completions")])
def test_unknown_path_is_openai_404(server, method, path):
    r = httpx.request(method, f"{server.base}{path}", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 404, r.text
    err = _openai_error(r)
    assert err["type"] == "invalid_request_error"
    msg = err["message"]
    assert f"no route {method} {path};" in msg, msg
    # the served endpoints, read from the app's routes (OpenAI ones first)
    assert "POST /v1/completions" in msg and "POST /v1/chat/completions" in msg and "GET /v1/models" in msg, msg
    assert msg.index("/v1/models") < msg.index("/health"), msg


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"),
    ("POST", "/health", "GET, HEAD")])
def test_wrong_method_is_openai_405_with_allow(server, method, path, allow):
    r = httpx.request(method, f"{server.base}{path}", timeout=30)
    assert r.status_code == 405, r.text
    # the order of several methods follows a set's (starlette's route methods)
    got = r.headers["allow"]
    assert sorted(got.split(", ")) == sorted(allow.split(", ")), got
    err = _openai_error(r)
    assert err["type"] == "invalid_request_error"
    assert err["message"] == f"method {method} is not allowed on {path}; it takes {got}", err


def test_openai_client_gets_not_found_for_an_unserved_endpoint(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="builtin:smollm2-135m-instruct", input="hi")
    assert "no route POST /v1/embeddings" in e.value.message


def test_body_must_be_sent_as_json(server):
    """A JSON body sent as text/plain (or with no content type) is refused, as vLLM does;
    application/json with parameters is fine."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for path in ("completions", "chat/completions"):
        for headers, sent in (({"content-type": "text/plain"}, "as 'text/plain'"), ({}, "without a content type")):
            r = httpx.post(f"{server.v1}/{path}", content=body, headers=headers, timeout=30)
            assert r.status_code == 400, r.text
            err = _openai_error(r)
            assert err["type"] == "invalid_request_error"
            assert err["message"] == f"the request body was sent {sent}; send application/json", err
    r = httpx.post(f"{server.v1}/completions", content=body,
                   headers={"content-type": "Application/JSON; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text
