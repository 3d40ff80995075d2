"""Structured output through a real server with the embedded default: 50 JSON schemas (every
output that finishes with "stop" parses and validates with jsonschema, streaming and not;
one cut by max_tokens says "length"), regex and choice outputs match, and tool calls
round-trip through the openai client in each --tool-call-parser format (hermes, llama3_json,
mistral; calls forced by the format's grammar), streaming and not; a call cut by max_tokens
says "length" and leaks no call text; bad constraints are 400s."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest
from kiln_server import start_server, stop_server

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


_DEFS = {"$defs": {"pt": _obj({"x": I, "y": I})}}
SCHEMAS = [
    _obj({"name": S}), _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"ok": B}), _obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}), _obj({"n": {"const": 3}}),
    _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    _obj({"xs": {"type": "array", "items": I, "minItems": 2, "maxItems": 2}}),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _obj({"d": {"type": "string", "format": "date"}}), _obj({"e": {"type": "string", "format": "email"}}),
    _obj({"u": {"type": "string", "format": "uuid"}}), _obj({"t": {"type": "string", "format": "time"}}),
    _obj({"s": {"type": "string", "minLength": 2, "maxLength": 6}}),
    _obj({"p": _obj({"q": S})}), _obj({"a": _obj({"b": _obj({"c": I})})}),
    _obj({"v": {"anyOf": [I, S]}}), _obj({"v": {"anyOf": [_obj({"k": I}), _obj({"j": B})]}}),
    {**_DEFS, **_obj({"p": {"$ref": "#/$defs/pt"}})},
    {**_DEFS, **_obj({"ps": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2}})},
    _obj({"x": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    _obj({"m": {"type": "integer", "minimum": -5, "maximum": -1}}),
    _obj({"opt": S, "req": I}, required=["req"]), _obj({"nul": {"type": "null"}}),
    _obj({"ns": {"type": ["string", "null"]}}), _obj({"f": N, "g": N}),
    _obj({"rows": {"type": "array", "items": _obj({"id": I}), "minItems": 1, "maxItems": 2}}),
    _obj({"level": {"enum": [1, 2, 3]}}), _obj({"mixed": {"enum": ["a", 1, True, None]}}),
    _obj({"name": S, "age": I, "city": S}), _obj({"title": {"type": "string", "maxLength": 10}, "pages": I}),
    {"type": "array", "items": I, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 4},
    {"enum": ["yes", "no"]}, {"type": "integer", "minimum": 10, "maximum": 99}, {"type": "boolean"},
    {"type": "string", "pattern": "^[a-z]{1,8}$"}, {"type": "number", "minimum": -1, "maximum": 1},
    _obj({"meta": {"type": "object", "additionalProperties": I, "maxProperties": 2}}),
    _obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}}),
    _obj({"id": {"type": "string", "format": "ipv4"}}), _obj({"dt": {"type": "string", "format": "date-time"}}),
    _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    {**_DEFS, **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
    _obj({"r": {"anyOf": [{"type": "null"}, {"enum": ["on", "off"]}]}}),
    _obj({"person": _obj({"first": S, "last": S}), "active": B}),
    _obj({"list": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}}),
    _obj({"k": {"type": "integer", "minimum": 0, "maximum": 0}}),
    _obj({"word": {"enum": ["alpha", "beta"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9}}),
]
# jsonschema's "time" check without the optional rfc3339-validator is strptime("%H:%M:%S"), which
# refuses RFC 3339 times with fractions or offsets ("20:17:12.77-00:00"): checked with RFC 3339's rule.
_FORMATS = jsonschema.FormatChecker([f for f in jsonschema.FormatChecker.checkers if f != "time"])
_FORMATS.checks("time")(lambda v: not isinstance(v, str) or re.fullmatch(
    r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([zZ]|[+-]([01]\d|2[0-3]):[0-5]\d)", v) is not None)
PROMPT = [{"role": "user", "content": "Answer with a JSON value that matches what is asked."}]


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.v1, api_key="x", timeout=600, max_retries=0)


def test_fifty_schemas_validate(aclient):
    assert len(SCHEMAS) >= 50

    async def one(i, schema, stream):
        kw = dict(model="builtin:smollm2-135m-instruct", messages=PROMPT, temperature=0.7, seed=i,
                  max_tokens=96, response_format={"type": "json_schema", "json_schema": {"name": f"s{i}",
                                                                                          "schema": schema}})
        if not stream:
            r = await aclient.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, reason = "", None
        async for ch in await aclient.chat.completions.create(**kw, stream=True):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                reason = ch.choices[0].finish_reason or reason
        return text, reason

    async def run():
        return await asyncio.gather(*(one(i, s, st) for st in (False, True) for i, s in enumerate(SCHEMAS)))

    results = asyncio.run(run())
    stops = 0
    for k, (text, reason) in enumerate(results):
        schema = SCHEMAS[k % len(SCHEMAS)]
        assert reason in ("stop", "length"), (k, reason)
        if reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(text), schema, format_checker=_FORMATS)
        else:
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)
    assert stops >= len(results) * 3 // 4, f"only {stops} of {len(results)} finished"


def test_regex_choice_and_length(server):
    c = openai.OpenAI(base_url=server.v1, api_key="x", timeout=600)
    m = "builtin:smollm2-135m-instruct"
    r = c.completions.create(model=m, prompt="An email address:", max_tokens=24, temperature=0,
                             extra_body={"guided_regex": r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)",
                                                                 r.choices[0].text), r.choices[0]
    r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
                                  extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model=m, messages=PROMPT, max_tokens=3, temperature=0,
                                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema":
                                                   _obj({"name": S, "city": S})}})
    assert r.choices[0].finish_reason == "length"  # cut: never reported as a complete object

    class Person(pydantic.BaseModel):
        name: str
        age: int

    p = c.chat.completions.parse(model=m, messages=[{"role": "user", "content": "Give me a person."}],
                                 response_format=Person, max_tokens=60, temperature=0)
    assert isinstance(p.choices[0].message.parsed, Person)
    # compile time is its own histogram, outside the queue time (the autoscaling signal)
    assert server.metric("kiln_request_grammar_compile_time_seconds_count") >= 4


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                             "parameters": _obj({"city": S})}}]
RAW_MARKERS = ("<tool_call>", "[TOOL_CALLS]", '{"name"')


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral"])
def tool_server(request, server):
    """A server per ``--tool-call-parser`` format (hermes: the shared one)."""
    if request.param == "hermes":
        yield server
        return
    s = start_server("--tool-call-parser", request.param, "--max-num-seqs", "8", "--max-model-len", "2048",
                     "--grammar-compile-timeout", "1")
    yield s
    stop_server(s)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_round_trip(tool_server, choice, stream):
    """Forced calls in each format (parallel calls allowed): complete calls, then the end
    ("tool_calls"), none of the format's text in ``content``, and the next turn accepted."""
    c = openai.OpenAI(base_url=tool_server.v1, api_key="x", timeout=600)
    m = "builtin:smollm2-135m-instruct"
    kw = dict(model=m, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=WEATHER,
              tool_choice=choice, max_tokens=200, temperature=0)
    if stream:
        with c.chat.completions.stream(**kw) as s:
            final = s.get_final_completion()
    else:
        final = c.chat.completions.create(**kw)
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls", final
    assert not msg.content or not any(k in msg.content for k in RAW_MARKERS), msg
    assert msg.tool_calls and len(msg.tool_calls) <= 3, msg  # a call repeated word for word ends the turn
    args = [json.loads(t.function.arguments) for t in msg.tool_calls]
    assert all(t.function.name == "get_weather" and isinstance(a["city"], str) for t, a in zip(msg.tool_calls, args))
    assert len({json.dumps(a, sort_keys=True) for a in args}) == len(args)
    call = msg.tool_calls[0]
    follow = c.chat.completions.create(model=m, max_tokens=8, tools=WEATHER, messages=[
        *kw["messages"], msg.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": t.id, "content": '{"temperature": 21}'} for t in msg.tool_calls)])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if stream or choice == "required":
        return

    class GetWeather(pydantic.BaseModel):  # the openai client's parsing helper on a strict tool
        city: str

    p = c.chat.completions.parse(model=m, messages=kw["messages"], tools=[openai.pydantic_function_tool(GetWeather)],
                                 tool_choice={"type": "function", "function": {"name": "GetWeather"}},
                                 max_tokens=60, temperature=0)
    assert isinstance(p.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)
    assert call.id != p.choices[0].message.tool_calls[0].id


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_cut_by_max_tokens(tool_server, stream):
    """A forced call cut by max_tokens: finish_reason "length", no call, and none of its text
    as content."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": WEATHER,
            "tool_choice": "required", "max_tokens": 10, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(f"{tool_server.v1}/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "length" and not ch["message"].get("tool_calls"), ch
        assert not ch["message"]["content"], ch
        return
    content, reasons, calls = "", [], []
    with httpx.stream("POST", f"{tool_server.v1}/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    content += ch["delta"].get("content") or ""
                    calls += ch["delta"].get("tool_calls") or []
                    reasons.append(ch["finish_reason"])
    assert reasons[-1] == "length" and content == "" and calls == [], (content, reasons)


@pytest.mark.parametrize("extra,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": []}}}},
     "invalid JSON schema: at $.anyOf: [] should be non-empty"),
    ({"structured_outputs": {"foo": 1}}, "structured_outputs: unknown field 'foo'"),
    ({"guided_regex": "[a-z]+", "tools": WEATHER}, "tools cannot be combined with response_format"),
    ({"response_format": {"type": "json_object"}, "tools": WEATHER, "tool_choice": "auto"},
     "tools cannot be combined with response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>"}], "triggers": ["<f>"]}},
     'structures[0] needs "begin", "schema" and "end"'),
])
def test_bad_constraints_are_400s(server, extra, needle):
    r = httpx.post(f"{server.v1}/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_structural_tag_response_format(server):
    """vLLM's structures / triggers form: free text until a trigger, then the tag's schema."""
    fn = _obj({"n": {"type": "integer", "minimum": 1, "maximum": 9}})
    r = httpx.post(f"{server.v1}/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Write <n> then a JSON object with a digit n, then </n>."}],
        "max_tokens": 40, "temperature": 0, "response_format": {
            "type": "structural_tag", "triggers": ["<n>"],
            "structures": [{"begin": "<n>", "schema": fn, "end": "</n>"}]}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    for body in re.findall(r"<n>(.*?)</n>", text, re.S):
        jsonschema.validate(json.loads(body), fn)
    assert "<n>" not in text or "</n>" in text or r.json()["choices"][0]["finish_reason"] == "length"


def _schema_compiling_for(min_seconds: float) -> dict:
    """An object schema of string properties that takes about ``min_seconds`` to compile with
    the embedded default's tokenizer on this machine: one probe of 400 properties is timed and
    the count scaled by the cube root of the ratio (xgrammar 0.2.9's compile time grows about
    with the cube of the properties: 0.33 s for 400, 7.2 s for 1,200 and 98 s for 2,400 on a
    2-core machine; the machine decides the rate), so the server, compiling the result, runs
    past its timeout whatever the machine's speed, and its compile threads are free again soon."""
    from kiln.runtime.loader import load_tokenizer, resolve_source
    from kiln.runtime.structured_output.backend import GrammarCompilerCache
    from kiln.runtime.structured_output.spec import json_spec

    def wide(n: int) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}

    tok = load_tokenizer(resolve_source("builtin:smollm2-135m-instruct"))
    cache = GrammarCompilerCache(tok, len(tok), [tok.eos_token_id])
    n = 400
    t0 = time.perf_counter()
    cache.get(json_spec(wide(n)))
    took = time.perf_counter() - t0
    return wide(max(n, int(n * (min_seconds / max(took, 1e-3)) ** (1 / 3))))


def test_grammar_over_the_compile_timeout_is_400(tool_server, server, request):
    """A schema that compiles for longer than --grammar-compile-timeout (1 s on the format
    servers; the schema is sized here to compile for about 3 s): a 400 before anything is
    streamed, and the server serves the next request.  On one format server: the timeout
    does not depend on the tool-call parser."""
    if tool_server is server or request.node.callspec.params["tool_server"] != "llama3_json":
        pytest.skip("on the llama3_json server only (the shared server keeps the default timeout)")
    wide = _schema_compiling_for(3.0)
    for stream in (False, True):
        r = httpx.post(f"{tool_server.v1}/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": wide}}})
        assert r.status_code == 400, r.text
        assert "did not compile within 1 s (--grammar-compile-timeout)" in r.json()["error"]["message"]
        wide["properties"]["extra"] = S  # another schema: not the one compiling on
    plain = httpx.post(f"{tool_server.v1}/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert plain.status_code == 200, plain.text  # requests without a grammar never wait for the compiles
    # the refused compiles run on to their end on the compile threads (xgrammar cannot stop them); a
    # grammar meanwhile is refused with a retry hint, never left waiting, and is served once a thread is free
    for _ in range(60):
        ok = httpx.post(f"{tool_server.v1}/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "guided_choice": ["yes", "no"]})
        if ok.status_code != 400 or "for a compile thread" not in ok.json()["error"]["message"]:
            break
        time.sleep(2)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no"), ok.text
