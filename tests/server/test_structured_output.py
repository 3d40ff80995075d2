"""Structured output through a real server with the embedded default: 50 JSON schemas (nearly
every output finishes with "stop", and each that does parses and validates with jsonschema,
streaming and not; one cut by max_tokens says "length"), json_object outputs are objects, EBNF
and Lark grammar outputs are accepted by their grammar, regex and choice outputs match,
streaming and not; tool calls round-trip through the openai client in each --tool-call-parser
format (hermes, llama3_json, mistral; calls forced by the format's grammar), streaming and not;
``tool_choice`` auto gives text or calls and none hides the tools; a template that reads
``tools`` renders them itself; a call cut by max_tokens says "length" and leaks no call text;
bad constraints are 400s."""

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
M = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def aclient(server):
    # the 50-schema test queues 100 requests on 64 sequences: the last wait for the first
    return openai.AsyncOpenAI(base_url=server.v1, api_key="x", timeout=1200, max_retries=0)


def test_fifty_schemas_validate(aclient):
    """Each schema, given in the prompt, streamed and not (seeded sampling): nearly every output
    ends ("stop") within max_tokens, and every one that does parses and validates; the few that
    run on (a string or number the grammar lets grow, e.g. an email or a time's fraction) end
    with "length" after exactly max_tokens tokens, never reported as complete."""
    assert len(SCHEMAS) >= 50
    max_tokens = 128

    async def one(i, schema, stream):
        msgs = [{"role": "user", "content": "Answer with a short JSON value that matches this JSON schema: "
                 + json.dumps(schema)}]
        kw = dict(model=M, messages=msgs, temperature=0.7, seed=i, max_tokens=max_tokens,
                  response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        if not stream:
            r = await aclient.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        text, reason, used = "", None, None
        async for ch in await aclient.chat.completions.create(**kw, stream=True,
                                                              stream_options={"include_usage": True}):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                reason = ch.choices[0].finish_reason or reason
            if ch.usage:
                used = ch.usage.completion_tokens
        return text, reason, used

    async def run():
        return await asyncio.gather(*(one(i, s, st) for st in (False, True) for i, s in enumerate(SCHEMAS)))

    results = asyncio.run(run())
    stops = 0
    for k, (text, reason, used) in enumerate(results):
        schema = SCHEMAS[k % len(SCHEMAS)]
        assert reason in ("stop", "length"), (k, reason)
        if reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(text), schema, format_checker=_FORMATS)
        else:
            assert used == max_tokens, (k, used, text)
    # 94 of 100 finish here; the email, the time's fraction and the anyOf's integer run on,
    # streamed and not
    assert stops >= len(results) * 9 // 10, f"only {stops} of {len(results)} finished"


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


EBNF = '''root ::= greet ", " name "!"
greet ::= "Hello" | "Hi"
name ::= [A-Z] [a-z] [a-z]? [a-z]? [a-z]? [a-z]?'''
LARK = '''start: item ("," item)? ("," item)?
item: NUMBER | WORD
NUMBER: /[0-9]{1,3}/
WORD: /[a-z]{2,6}/
'''


def _grammar_accepts(grammar, text: str) -> bool:
    """``text`` is a complete sentence of ``grammar`` (an xgrammar ``Grammar``): xgrammar's
    matcher walks its characters (over a one-token vocabulary: no tokenizer involved) and
    ends where the grammar may end."""
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["<eos>"], stop_token_ids=[0])).compile_grammar(grammar)
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


def test_json_object_and_grammars(server):
    """``response_format: json_object`` gives a JSON object; ``guided_grammar`` in EBNF and in
    Lark gives a sentence of the grammar (xgrammar's matcher, and the lark library's parser
    for the Lark one)."""
    import lark
    import xgrammar as xgr

    assert _grammar_accepts(xgr.Grammar.from_ebnf(EBNF), "Hi, Ann!")  # the checks can say no
    assert not _grammar_accepts(xgr.Grammar.from_ebnf(EBNF), "Hi, Ann")
    assert not _grammar_accepts(xgr.Grammar.from_lark(LARK), "1234")

    async def run():  # at once: one batch
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", timeout=600, max_retries=0) as c:
            return await asyncio.gather(
                c.chat.completions.create(model=M, max_tokens=96, temperature=0,
                                          response_format={"type": "json_object"},
                                          messages=[{"role": "user", "content": "Describe a cat as a JSON object."}]),
                c.chat.completions.create(model=M, max_tokens=16, temperature=0.7, seed=2,
                                          extra_body={"guided_grammar": EBNF},
                                          messages=[{"role": "user", "content": "Greet someone by name."}]),
                c.completions.create(model=M, prompt="Three short words or numbers, separated by commas:",
                                     max_tokens=24, temperature=0.7, seed=3, extra_body={"guided_grammar": LARK}))

    obj, ebnf, lk = asyncio.run(run())
    assert obj.choices[0].finish_reason == "stop", obj.choices[0]
    assert isinstance(json.loads(obj.choices[0].message.content), dict), obj.choices[0].message.content
    text = ebnf.choices[0].message.content
    assert ebnf.choices[0].finish_reason == "stop", ebnf.choices[0]
    assert _grammar_accepts(xgr.Grammar.from_ebnf(EBNF), text) and re.fullmatch(r"(Hello|Hi), [A-Z][a-z]{1,5}!",
                                                                               text), text
    text = lk.choices[0].text
    assert lk.choices[0].finish_reason == "stop", lk.choices[0]
    assert _grammar_accepts(xgr.Grammar.from_lark(LARK), text), text
    lark.Lark(LARK).parse(text)  # raises on text outside the grammar


def test_regex_and_choice_streamed(server):
    """Streamed regex and choice outputs: the deltas join into a match, the last chunk says
    "stop"."""
    c = openai.OpenAI(base_url=server.v1, api_key="x", timeout=600, max_retries=0)
    email = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"
    deltas, reasons = [], []
    for ch in c.completions.create(model=M, prompt="An email address:", max_tokens=24, temperature=0.7, seed=5,
                                   stream=True, extra_body={"guided_regex": email}):
        deltas.append(ch.choices[0].text)
        reasons.append(ch.choices[0].finish_reason)
    assert reasons[-1] == "stop" and re.fullmatch(email, "".join(deltas)), (deltas, reasons)
    assert sum(bool(d) for d in deltas) > 1  # streamed in pieces, not one final chunk
    for seed in (1, 2):
        text, reasons = "", []
        for ch in c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                            max_tokens=8, temperature=1.0, seed=seed, stream=True,
                                            extra_body={"guided_choice": ["yes", "no", "maybe"]}):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                reasons.append(ch.choices[0].finish_reason)
        assert text in ("yes", "no", "maybe") and reasons[-1] == "stop", (text, reasons)


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


async def _chat_message(c: openai.AsyncOpenAI, stream: bool, **kw) -> tuple[str | None, list[tuple[str, str]],
                                                                          str | None, int]:
    """``(content, [(name, arguments)], finish_reason, prompt tokens)`` of a chat; streamed:
    joined from its deltas (the tool-call deltas by their index)."""
    if not stream:
        r = await c.chat.completions.create(**kw)
        ch = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        return ch.message.content or None, calls, ch.finish_reason, r.usage.prompt_tokens
    content, calls, reason, prompt = "", {}, None, None
    async for ch in await c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ch.usage:
            prompt = ch.usage.prompt_tokens
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for t in delta.tool_calls or []:
            name, args = calls.get(t.index, ("", ""))
            calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
        reason = ch.choices[0].finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason, prompt


def test_tool_choice_auto_and_none(server):
    """``auto`` (hermes; SmolLM2's template does not read ``tools``, so they are described in
    a system turn): the output is text or parsed calls, finish_reason "tool_calls" exactly when
    there are calls, each a call of a given tool with JSON object arguments, text with no
    complete call left in it, the same streamed and not.  Greedy, a plain question gets text
    and a chat whose earlier turn called the tool gets a call.  ``none``: the tools are not
    shown (the prompt is the chat's without tools) and the output is text, streamed and not."""
    from kiln.runtime.structured_output.tool_parsers import get_parser

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "user", "content": "What is the weather in Rome?"}]
    auto = [dict(messages=ask, tool_choice="auto", max_tokens=24), dict(messages=called, tool_choice="auto",
                                                                         max_tokens=40)]  # the call takes 31 tokens
    none = dict(messages=called, tool_choice="none", max_tokens=8)

    async def run():  # at once: one batch
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", timeout=600, max_retries=0) as c:
            return await asyncio.gather(*(_chat_message(c, st, model=M, tools=WEATHER, temperature=0, **kw)
                                          for kw in (*auto, none) for st in (False, True)),
                                        *(_chat_message(c, False, model=M, messages=m, max_tokens=1)
                                          for m in (ask, called)))

    *outs, bare_ask, bare_called = asyncio.run(run())
    kinds = []
    for k, bare in ((0, bare_ask), (1, bare_called)):
        plain, streamed = outs[2 * k], outs[2 * k + 1]
        assert streamed == plain, (streamed, plain)
        content, calls, reason, prompt = plain
        if calls:
            assert reason == "tool_calls", plain
            assert all(name == "get_weather" and isinstance(json.loads(a), dict) for name, a in calls), calls
            assert not content or not any(m in content for m in RAW_MARKERS), plain
        else:
            assert reason in ("stop", "length") and content, plain
            assert get_parser("hermes").parse(content, final=True).calls == [], plain
        kinds.append("calls" if calls else "text")
        assert prompt > bare[3]  # auto shows the tools
    assert kinds == ["text", "calls"], kinds
    for content, calls, reason, prompt in outs[4:]:  # none: text, the prompt without the tools
        assert content and calls == [] and reason in ("stop", "length") and prompt == bare_called[3], outs[4:]


# A chat template that reads ``tools`` (as Qwen's, Llama 3.1's and Hermes' do): each tool's
# function as JSON in a system turn of its own.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\nFunctions:\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def tools_template_model(tmp_path_factory):
    """A tiny Llama folder (random weights at load) whose tokenizer's chat template reads
    ``tools``: the synthetic byte-level BPE of 512 tokens with ``TOOLS_TEMPLATE``."""
    from kiln.runtime.synthetic_tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("tools-template")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    tok = build_tokenizer(512, 1, [2])
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(str(d))
    return d


def _template_ids(tok, msgs, tools=None) -> list[int]:
    ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_template_reading_tools_renders_them(tools_template_model):
    """A template that reads ``tools`` gets OpenAI's definitions and renders them itself: the
    chat is passed on as it is (no system turn of the parser's) and the rendered prompt holds
    each tool's name, description and parameters."""
    from transformers import AutoTokenizer

    from kiln.runtime.processing.input import InputProcessor, ModelLimits
    from kiln.runtime.server.protocol import ChatCompletionRequest
    from kiln.runtime.server.tool_calling import plan_tools, prepare_conversation

    tok = AutoTokenizer.from_pretrained(str(tools_template_model))
    ip = InputProcessor(tok, ModelLimits(1024, 512, 16, 64, "tiny"))
    assert ip.template_supports_tools
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER)
    plan = plan_tools(req, "hermes")
    conv, tools = prepare_conversation(req.conversation(), plan, ip.template_supports_tools)
    assert conv == req.conversation() and tools == WEATHER
    text = tok.decode(ip.apply_chat_template(conv, tools))
    assert json.dumps(WEATHER[0]["function"]) in text, text
    assert text.startswith("<|system|>\nFunctions:") and "You can call functions" not in text, text
    # the other path, for a template without tools: the parser's system turn, no tools argument
    conv2, tools2 = prepare_conversation(req.conversation(), plan, False)
    assert tools2 is None and conv2[0]["role"] == "system" and "get_weather" in conv2[0]["content"]


def test_template_reading_tools_over_http(tools_template_model):
    """Served: the prompt of a chat with tools is the template's own rendering of them
    (``auto``; its token count differs from the parser's system-turn rendering), and without
    them for ``none``."""
    from transformers import AutoTokenizer

    from kiln.runtime.server.protocol import ChatCompletionRequest
    from kiln.runtime.server.tool_calling import plan_tools, prepare_conversation

    tok = AutoTokenizer.from_pretrained(str(tools_template_model))
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools, without = _template_ids(tok, msgs, WEATHER), _template_ids(tok, msgs)
    plan = plan_tools(ChatCompletionRequest(messages=msgs, tools=WEATHER), "hermes")
    system_turn = _template_ids(tok, prepare_conversation(msgs, plan, False)[0])
    assert len({len(with_tools), len(without), len(system_turn)}) == 3  # the counts tell the paths apart
    s = start_server("--model", str(tools_template_model), "--load-format", "dummy", "--max-model-len", "1024",
                     "--served-model-name", "tiny")
    try:
        c = openai.OpenAI(base_url=s.v1, api_key="x", timeout=300, max_retries=0)
        for choice, want in (("auto", with_tools), ("none", without)):
            r = c.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER,
                                          tool_choice=choice, max_tokens=2, temperature=0)
            assert r.usage.prompt_tokens == len(want), (choice, r.usage)
    finally:
        stop_server(s)


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
