"""``kiln serve --speculative-method ngram`` with the official ``openai`` client: a streamed
greedy completion equals the non-streamed one, and ``/metrics`` counts drafts and accepted
tokens."""

from __future__ import annotations

import pytest

from kiln_server import start_server, stop_server

PROMPT = ("Repeat the following text exactly.\nText: The quick brown fox jumps over the lazy dog. The dog sleeps "
          "in the sun while the fox runs into the green forest.\nRepeated text: The quick brown fox")


@pytest.fixture(scope="module")
def spec_server():
    s = start_server("--max-num-seqs", "8", "--num-kv-blocks", "128", "--speculative-method", "ngram",
                     "--num-speculative-tokens", "4")
    yield s
    stop_server(s)


def test_streamed_completion_and_spec_metrics(spec_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=spec_server.v1, api_key="none")
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in chunks)
    # the model ends on EOS inside a verified run: the text stops there, as without drafts
    assert streamed == full.choices[0].text and full.choices[0].finish_reason == "stop"
    drafts = spec_server.metric("kiln_spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("kiln_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts
    assert spec_server.metric("kiln_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert spec_server.metric("kiln_spec_decode_mean_accepted_length") > 1.0
    # the switch-off's measured rate of the one-sequence bucket, with drafts
    assert spec_server.metric("kiln_spec_decode_output_tokens_per_second", batch_sizes="1-1", mode="speculative") > 0
