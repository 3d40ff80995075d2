"""Structured output pieces without a model: the bitmask op against xgrammar's layout, the
spec built from each request spelling, its trip through the core's message encoding, and
the 400 messages of bad specs."""

from __future__ import annotations

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
