"""Incremental detokenization: equals a full decode, never emits broken UTF-8, stop strings
across token boundaries are cut and never streamed."""

from __future__ import annotations

import pytest

from kiln.runtime.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow  # loads the embedded model's tokenizer (seconds)

TEXTS = ["Hello, world! How are you?", "naïve café — 東京 🚀 emoji 👩‍👩‍👧 end", "def f(x):\n    return x**2\n",
         "  leading spaces and\ttabs"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True)
    streamed = ""
    for t in ids:
        assert d.add_token(t) is None
        delta = d.take_delta(False)
        assert "\ufffd" not in delta
        streamed += delta
    d.flush()
    streamed += d.take_delta(True)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens(tokenizer):
    text = "The answer is forty-two. Next question"
    ids = tokenizer.encode(text)
    stop = "two. Ne"
    d = IncrementalDetokenizer(tokenizer, [1], stop=[stop])
    streamed, matched = "", None
    for t in ids:
        matched = d.add_token(t)
        streamed += d.take_delta(matched is not None)
        if matched:
            break
    assert matched == stop
    assert d.text == "The answer is forty-"
    assert streamed == d.text and stop not in streamed
