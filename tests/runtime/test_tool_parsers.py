"""Tool-call formats: parsing whole and streamed outputs, the forcing grammar accepts what the
renderer writes (and refuses other text), and the CLI's parser names are the parsers'."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from kiln.runtime.structured_output.spec import GrammarSpec, build_grammar
from kiln.runtime.structured_output.tool_parsers import PARSERS, ToolCallStream, get_parser, repeat_cut

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
                                           "required": ["tz"]}}
CALLS = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "cet"}'}}]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_render_parse_round_trip(name):
    p = get_parser(name)
    text = p.render_calls(CALLS)
    got = p.parse(text, final=True)
    assert got.ok and [(c.name, json.loads(c.arguments)) for c in got.calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "cet"})]
    assert got.content.strip() == ""
    plain = p.parse("The weather is fine.", final=True)
    assert plain.calls == [] and plain.content == "The weather is fine."


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_stream_deltas_equal_whole_parse(name):
    p = get_parser(name)
    prefix = "" if name == "llama3_json" else "Let me check. "
    text = prefix + p.render_calls(CALLS)
    st = ToolCallStream(p)
    content, calls = "", []
    for i in range(0, len(text), 3):  # 3-character deltas split every marker somewhere
        c, new = st.feed(text[i:i + 3])
        content += c
        calls += new
    c, new = st.feed("", final=True)
    content += c
    calls += new
    assert content == prefix
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in calls] == \
        [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {"tz": "cet"})]
    assert all(d["type"] == "function" and d["id"].startswith("call_") for d in calls)


def test_hermes_unfinished_call_keeps_the_complete_ones():
    p = get_parser("hermes")
    text = p.render_calls(CALLS[:1]) + '\n<tool_call>\n{"name": "get_ti'
    got = p.parse(text, final=True)
    assert [c.name for c in got.calls] == ["get_weather"] and got.content.strip().startswith("<tool_call>")
    assert p.parse('<tool_call>\n{"name": oops}\n</tool_call>', final=True).calls == []


def _partial(p, calls) -> str:
    """The calls rendered in ``p``'s format, then a third call cut in its arguments."""
    whole = p.render_calls([*calls, {"function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}])
    return whole[: whole.index('"Lyon"') + 3]


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("num_complete", [0, 2])
def test_call_cut_by_max_tokens_is_not_content(name, num_complete):
    p = get_parser(name)
    prefix = "" if name == "llama3_json" else "Let me check. "
    text = prefix + _partial(p, CALLS[:num_complete])
    got = p.parse(text, final=True, cut=True)
    assert [c.name for c in got.calls] == ["get_weather", "get_time"][:num_complete]
    assert got.content.strip() == prefix.strip() and not got.ok
    st = ToolCallStream(p)  # streamed: the held-back call text is not flushed at the end either
    content = "".join(st.feed(text[i:i + 4])[0] for i in range(0, len(text), 4)) + st.feed("", True, True)[0]
    assert content == prefix and len(st.calls_sent) == num_complete
    if num_complete:  # not cut (a stop inside a call): the broken text stays visible
        assert '"city": "Ly' in p.parse(text, final=True).content


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_repeated_call_cuts_the_output_after_the_distinct_ones(name):
    p = get_parser(name)
    again = {"function": {"name": "get_weather", "arguments": '{ "city":"Paris" }'}}  # same JSON, other spacing
    text = p.render_calls([*CALLS, again, CALLS[1]])
    pos = repeat_cut(p, text)
    assert pos is not None
    got = p.parse(text[:pos], final=True)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Paris"}),
                                                                      ("get_time", {"tz": "cet"})]
    assert repeat_cut(p, p.render_calls(CALLS)) is None
    other = {"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert repeat_cut(p, p.render_calls([*CALLS, other])) is None


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_forcing_grammar_accepts_the_format_only(name):
    p = get_parser(name)
    tag = p.structural_tag([WEATHER, TIME], at_least_one=True, stop_after_first=False)
    g = build_grammar(GrammarSpec("structural_tag", json.dumps(tag)))
    assert _is_grammar_accept_string(g, p.render_calls(CALLS))
    assert _is_grammar_accept_string(g, p.render_calls(CALLS[:1]))
    assert not _is_grammar_accept_string(g, "")  # required: at least one call
    assert not _is_grammar_accept_string(g, "Sure! " + p.render_calls(CALLS[:1]))
    bad = [{"function": {"name": "get_time", "arguments": '{"tz": "pst"}'}}]  # outside the enum
    assert not _is_grammar_accept_string(g, p.render_calls(bad))
    one = p.structural_tag([TIME], at_least_one=True, stop_after_first=True)
    g1 = build_grammar(GrammarSpec("structural_tag", json.dumps(one)))
    assert _is_grammar_accept_string(g1, p.render_calls(CALLS[1:]))
    assert not _is_grammar_accept_string(g1, p.render_calls(CALLS))


def test_cli_parser_names_are_the_parsers():
    from kiln.runtime.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    action = next(a for a in serve._actions if a.dest == "tool_call_parser")
    assert set(action.choices) == set(PARSERS)
    assert serve.parse_args(["--tool-call-parser", "mistral"]).tool_call_parser == "mistral"



@pytest.mark.parametrize("name", ["hermes", "mistral"])
@pytest.mark.parametrize("num_complete", [0, 1])
def test_cut_inside_a_call_marker_is_not_content(name, num_complete):
    """max_tokens ending inside the next call's start marker (``\\n<tool_call``, ``[TOOL_CA``):
    the marker's start is not returned as content, whole or streamed."""
    p = get_parser(name)
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}[name]
    prefix = "Let me check. "
    calls = p.render_calls(CALLS[:num_complete]) if num_complete else ""
    if name == "mistral" and num_complete:
        return  # mistral's calls share one marker: a second marker never follows
    for k in range(1, len(marker)):
        text = prefix + calls + ("\n" if calls else "") + marker[:k]
        got = p.parse(text, final=True, cut=True)
        assert got.content.strip() == prefix.strip(), (k, got)
        assert [c.name for c in got.calls] == ["get_weather"][:num_complete]
        st = ToolCallStream(p)
        content = "".join(st.feed(text[i:i + 3])[0] for i in range(0, len(text), 3)) + st.feed("", True, True)[0]
        assert content.strip() == prefix.strip(), (k, content)
        assert p.parse(prefix + marker[:k], final=True).content == prefix + marker[:k]  # not cut: text


def test_a_repeat_in_the_last_output_is_cut_too():
    """A repeated call completed in the step that ends the choice (EOS after it) is cut as
    one completed earlier: the client never gets the same call twice."""
    import asyncio

    from kiln.runtime.outputs import CompletionOutput, RequestOutput
    from kiln.runtime.server.tool_calling import stop_repeated_calls

    p = get_parser("hermes")
    once = p.render_calls(CALLS[:1])
    text = once + "\n" + once

    async def gen():
        yield RequestOutput("r", None, [], [CompletionOutput(0, once[:10], [], delta_text=once[:10])])
        yield RequestOutput("r", None, [], [CompletionOutput(0, text, [], finish_reason="stop",
                                                             delta_text=text[10:])], finished=True)

    async def run():
        return [o async for o in stop_repeated_calls(gen(), p, 1)]

    outs = asyncio.run(run())
    last = outs[-1].outputs[0]
    assert last.finish_reason == "stop" and len(p.parse(last.text, final=True).calls) == 1
    assert outs[0].outputs[0].delta_text + last.delta_text == last.text
