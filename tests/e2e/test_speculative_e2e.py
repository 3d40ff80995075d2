"""examples/smollm2-speculative.yaml end to end: an InferenceEngine with
``runtime.speculative: {method: ngram}`` on the embedded default is built and served by the
in-cluster operator, answers, and its pod's /metrics show the n-gram drafts being verified
(``kiln_spec_decode_*`` counters moving with a copy-heavy request)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from kiln.devcluster.load import chat

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1800)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-speculative.yaml"
# A copy-heavy request: the answer repeats the given text, so prompt lookup finds its drafts.
TEXT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
        "The quick brown fox jumps over the lazy dog.")


def _counter(metrics: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", metrics, re.M))


def test_ngram_speculation_serves_and_counts_drafts(stack, ns, measure):
    ie = yaml.safe_load(EXAMPLE.read_text())
    name = ie["metadata"]["name"]
    stack.apply_file(EXAMPLE, ns)
    measure("apply -> Ready, ngram speculation", stack.wait_ready(name, ns))
    dep = json.loads(stack.kubectl("get", "deployment", name, "-n", ns, "-o", "json"))
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--speculative-method") + 1] == "ngram"
    proxy = stack.proxy(name, ns)
    proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))
    before = httpx.get(f"{proxy.url}/metrics", timeout=30).text
    answer = chat(proxy.url, f"Repeat this text exactly: {TEXT}", max_tokens=48, model=name)
    assert answer.strip(), answer
    after = httpx.get(f"{proxy.url}/metrics", timeout=30).text
    for counter in ("kiln_spec_decode_num_drafts_total", "kiln_spec_decode_num_draft_tokens_total"):
        assert _counter(after, counter) > _counter(before, counter), counter
    assert _counter(after, "kiln_spec_decode_num_accepted_tokens_total") >= _counter(
        before, "kiln_spec_decode_num_accepted_tokens_total")
    measure("ngram accepted tokens (one copy request)", _counter(after, "kiln_spec_decode_num_accepted_tokens_total")
            - _counter(before, "kiln_spec_decode_num_accepted_tokens_total"), unit="tokens")
