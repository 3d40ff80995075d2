"""Structured output pieces without a model: the bitmask op against xgrammar's layout, the
spec built from each request spelling, its trip through the core's message encoding, and
the 400 messages of bad specs."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from kiln.runtime.engine_core import messages as m
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.processing.input import check_structured_outputs
from kiln.runtime.sampler import apply_token_bitmask
from kiln.runtime.sampling_params import SamplingParams, StructuredOutputsParams as SO
from kiln.runtime.server.protocol import ChatCompletionRequest


@pytest.mark.parametrize("vocab", [31, 32, 100, 49152])
def test_bitmask_matches_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(5, vocab, generator=g) < 0.3
    allowed[2] = True  # an unconstrained row
    bm = torch.zeros(5, (vocab + 31) // 32, dtype=torch.int32)
    for r in range(5):  # xgrammar's layout: bit t % 32 of word t // 32
        for t in allowed[r].nonzero().flatten().tolist():
            bm[r, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    logits = torch.randn(5, vocab, generator=g)
    ref = logits.masked_fill(~allowed, float("-inf"))
    ours = apply_token_bitmask(logits.clone(), bm)
    assert torch.equal(ours, ref)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bm)
    assert torch.equal(ours, theirs)


def test_request_spellings_give_one_spec():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    specs = [ChatCompletionRequest(**base, **kw).to_sampling_params().structured_outputs.spec() for kw in (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}},
        {"guided_json": schema}, {"structured_outputs": {"json": schema}})]
    assert specs[0] == specs[1] == specs[2] and specs[0].text.index('"b"') < specs[0].text.index('"a"')
    assert ChatCompletionRequest(**base, response_format={"type": "json_object"}).to_sampling_params() \
        .structured_outputs.spec().kind == "json_object"
    assert ChatCompletionRequest(**base, guided_grammar='start: "a"').to_sampling_params() \
        .structured_outputs.spec().kind == "lark"
    assert ChatCompletionRequest(**base, response_format={"type": "text"}).to_sampling_params().structured_outputs is None
    p = SamplingParams(structured_outputs=SO(choice=["yes", "no"]))
    back = m.decode_client_message(m.encode(m.AddRequests([m.CoreRequest("r", [1], p, 4, 0.0)])))
    assert back.requests[0].params.structured_outputs.spec() == p.structured_outputs.spec()


@pytest.mark.parametrize("so,needle", [
    (SO(json={"type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}}), "invalid JSON schema"),
    (SO(regex="[a-"), "invalid regex"),
    (SO(grammar='root ::= "a" | '), "invalid EBNF grammar"),
    (SO(grammar="start: (("), "invalid Lark grammar"),
    (SO(json="{not json"), "not valid JSON"),
])
def test_bad_specs_are_400s(so, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        check_structured_outputs(so)


def test_params_refuse_two_constraints_and_min_tokens():
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+"))


@pytest.mark.parametrize("schema,needle", [
    ({"anyOf": []}, "invalid JSON schema: at $.anyOf: [] should be non-empty"),
    ({"allOf": []}, "invalid JSON schema: at $.allOf: [] should be non-empty"),
    ({"type": "array", "minItems": -1}, "at $.minItems: -1 is less than the minimum of 0"),
])
def test_schemas_breaking_the_meta_schema_are_400s(schema, needle):
    with pytest.raises(InvalidRequestError) as e:
        check_structured_outputs(SO(json=schema))
    assert needle in str(e.value)


def test_structural_tag_response_format_both_forms():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    fn = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    legacy = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": fn, "end": "</f>"}],
              "triggers": ["<f>"]}
    modern = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
        {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": fn}, "end": "</f>"}]}}
    specs = [ChatCompletionRequest(**base, response_format=rf).to_sampling_params().structured_outputs.spec()
             for rf in (legacy, modern)]
    assert specs[0] == specs[1] and specs[0].kind == "structural_tag"
    for s in specs:
        check_structured_outputs(SO(structural_tag=s.text))
    from xgrammar.testing import _is_grammar_accept_string

    from kiln.runtime.structured_output.spec import build_grammar

    g = build_grammar(specs[0])
    assert _is_grammar_accept_string(g, 'free text <f>{"a": 1}</f> more')
    assert not _is_grammar_accept_string(g, 'free text <f>{"a": "x"}</f>')
    via_so = ChatCompletionRequest(**base, structured_outputs={"structural_tag": {
        "structures": legacy["structures"], "triggers": ["<f>"]}}).to_sampling_params().structured_outputs.spec()
    assert via_so == specs[0]
    with pytest.raises(ValueError, match='needs "format"'):
        ChatCompletionRequest(**base, response_format={"type": "structural_tag"}).to_sampling_params()
    with pytest.raises(ValueError, match=r'structures\[0\] needs "begin", "schema" and "end"'):
        ChatCompletionRequest(**base, response_format={**legacy, "structures": [{"begin": "<f>"}]}).structured()


def test_structured_outputs_unknown_field_is_named():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], structured_outputs={"foo": 1})
    with pytest.raises(ValueError) as e:
        req.to_sampling_params()
    assert str(e.value).startswith("structured_outputs: unknown field 'foo' (the fields are json, json_object, regex")
    with pytest.raises(ValueError, match="structured_outputs: structured output needs exactly one"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], structured_outputs={}).structured()


@pytest.mark.parametrize("constraint", [{"guided_regex": "[a-z]+"}, {"guided_choice": ["a", "b"]},
                                        {"response_format": {"type": "json_object"}}])
@pytest.mark.parametrize("choice", [None, "auto", "required"])
def test_tools_with_another_constraint_are_400s(constraint, choice):
    from kiln.runtime.server.tool_calling import plan_tools

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=choice,
                                **constraint)
    with pytest.raises(InvalidRequestError, match="tools cannot be combined with response_format"):
        plan_tools(req, "hermes")
    none = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="none",
                                 **constraint)
    assert plan_tools(none, "hermes") is None and none.structured() is not None


def test_compile_timeout_refuses_and_others_still_compile():
    from kiln.runtime.structured_output.manager import StructuredOutputManager
    from kiln.runtime.structured_output.spec import GrammarSpec
    from kiln.runtime.synthetic_tokenizer import build_tokenizer

    tok = build_tokenizer(4096, 1, [2])
    so = StructuredOutputManager(lambda: tok, 4096, [2], compile_timeout=0.1)
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}  # ~1 s
    so.submit("slow", GrammarSpec("json", json.dumps(slow)))
    so.submit("fast", GrammarSpec("regex", "[a-z]{1,3}"))
    ready, failed = [], []
    while len(ready) + len(failed) < 2:
        so.wait_any(0.05)
        r, f = so.poll()
        ready += r
        failed += f
    assert [rid for rid, _ in ready] == ["fast"] and ready[0][1] >= 0 and so.has_grammar("fast")
    assert failed == [("slow", "the grammar did not compile within 0.1 s (--grammar-compile-timeout): simplify "
                               "the schema, regex or grammar")]
    assert not so.has_grammar("slow") and so.num_pending == 0
    so.shutdown()


def test_a_grammar_waiting_for_a_busy_compile_thread_fails_at_the_timeout():
    import threading
    import time

    from kiln.runtime.structured_output import backend
    from kiln.runtime.structured_output.manager import StructuredOutputManager
    from kiln.runtime.structured_output.spec import GrammarSpec
    from kiln.runtime.synthetic_tokenizer import build_tokenizer

    tok = build_tokenizer(4096, 1, [2])
    so = StructuredOutputManager(lambda: tok, 4096, [2], compile_timeout=0.2)
    so.submit("first", GrammarSpec("regex", "[a-z]{1,3}"))  # sets the tokenizer up
    while not so.poll()[0]:
        so.wait_any(0.05)
    release = threading.Event()
    busy = [so._compiler._pool.submit(release.wait) for _ in range(backend.COMPILE_THREADS)]  # every thread taken
    try:
        so.submit("queued", GrammarSpec("regex", "[0-9]{2}"))
        time.sleep(0.3)  # past the timeout; the queued compile cannot have started
        ready, failed = so.poll()
        assert ready == [] and [rid for rid, _ in failed] == ["queued"] and "for a compile thread" in failed[0][1]
        assert so.num_pending == 0 and not so.has_grammar("queued")
    finally:
        release.set()
    for f in busy:
        f.result()
    so.submit("after", GrammarSpec("regex", "[0-9]{2}"))  # the threads are free again: compiles
    while not (r := so.poll()[0]):
        so.wait_any(0.05)
    assert [rid for rid, _ in r] == ["after"]
    so.shutdown()


def test_one_compile_per_spec_cached_or_compiling():
    """The same schema for sequences submitted together (the ``n`` of a request, requests sent
    at once) compiles once, the later ones waiting for that compile; submitted again later it
    comes from the cache; another schema compiles; a bad spec fails every sequence asking."""
    from kiln.runtime.structured_output.manager import StructuredOutputManager
    from kiln.runtime.structured_output.spec import GrammarSpec
    from kiln.runtime.synthetic_tokenizer import build_tokenizer

    tok = build_tokenizer(4096, 1, [2])
    so = StructuredOutputManager(lambda: tok, 4096, [2])
    # wide enough (~0.1 s to compile) that the second compile thread takes "b" while "a" compiles
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}

    def settle(ids):
        ready, failed = [], []
        while len(ready) + len(failed) < len(ids):
            so.wait_any(0.05)
            r, f = so.poll()
            ready += [rid for rid, _ in r]
            failed += f
        return sorted(ready), failed

    so.submit("a", GrammarSpec("json", json.dumps(wide)))
    so.submit("b", GrammarSpec("json", json.dumps(wide)))
    assert settle("ab") == (["a", "b"], []) and so.num_compiles == 1
    so.submit("c", GrammarSpec("json", json.dumps(wide)))
    assert settle("c") == (["c"], []) and so.num_compiles == 1  # a cache hit
    so.submit("d", GrammarSpec("json", json.dumps({**wide, "required": ["p0"]})))
    assert settle("d") == (["d"], []) and so.num_compiles == 2
    so.submit("e", GrammarSpec("regex", "[a-"))
    so.submit("f", GrammarSpec("regex", "[a-"))
    ready, failed = settle("ef")
    assert ready == [] and sorted(rid for rid, _ in failed) == ["e", "f"], failed
    assert failed[0][1] == failed[1][1] and "invalid regex" in failed[0][1]
    assert all(so.has_grammar(r) for r in "abcd") and so.num_compiles == 2
    so.shutdown()


def test_earlier_calls_are_written_when_no_tools_are_shown():
    """``tool_choice: none`` (no plan) with a template that does not read ``tools``: an earlier
    assistant call is written into its turn in the served format, not dropped, and no
    tools are described."""
    from kiln.runtime.server.tool_calling import prepare_conversation
    from kiln.runtime.structured_output.tool_parsers import get_parser

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    for name in ("hermes", "llama3_json", "mistral"):
        parser = get_parser(name)
        out, tools = prepare_conversation(conv, None, False, parser)
        assert tools is None and [m["role"] for m in out] == ["user", "assistant", "tool"]
        assert out[1]["content"] == parser.render_calls([call]) and '"Paris"' in out[1]["content"]
