"""Structured output through a real server with the embedded default: 50 JSON schemas (every
output that finishes with "stop" parses and validates with jsonschema, streaming and not;
one cut by max_tokens says "length"), regex and choice outputs match, and tool calls
round-trip through the openai client (this server's format, hermes), streaming and not."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pydantic
import pytest

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


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                             "parameters": _obj({"city": S})}}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_round_trip(server, choice, stream):
    c = openai.OpenAI(base_url=server.v1, api_key="x", timeout=600)
    m = "builtin:smollm2-135m-instruct"
    kw = dict(model=m, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=WEATHER,
              tool_choice=choice, parallel_tool_calls=False, max_tokens=60, temperature=0)
    if stream:
        with c.chat.completions.stream(**kw) as s:
            final = s.get_final_completion()
    else:
        final = c.chat.completions.create(**kw)
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls", final
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    follow = c.chat.completions.create(model=m, max_tokens=8, tools=WEATHER, messages=[
        *kw["messages"], msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
