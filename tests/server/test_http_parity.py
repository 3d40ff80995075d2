"""Greedy output through HTTP (API process -> engine core process) equals the offline
``LLM`` on the runtime's parity prompts, raw and chat."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from prompts import CHATS, MAX_NEW_TOKENS, RAW_PROMPTS  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offline():
    from kiln.runtime import LLM

    return LLM(max_num_seqs=16, max_model_len=2048)


def test_greedy_http_equals_offline(server, offline):
    from kiln.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)
    want = [o.outputs[0].text for o in offline.generate(RAW_PROMPTS, params)]
    got = []
    for p in RAW_PROMPTS:
        r = httpx.post(f"{server.v1}/completions", timeout=300,
                       json={"prompt": p, "max_tokens": MAX_NEW_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    assert got == want
    want_chat = [o.outputs[0].text for c in CHATS for o in offline.chat(c, params)]
    got_chat = []
    for c in CHATS:
        r = httpx.post(f"{server.v1}/chat/completions", timeout=300,
                       json={"messages": c, "max_tokens": MAX_NEW_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        got_chat.append(r.json()["choices"][0]["message"]["content"])
    assert got_chat == want_chat
