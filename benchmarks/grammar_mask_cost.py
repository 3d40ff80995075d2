"""Per-token cost of a grammar engine's token bitmask on the CPU: xgrammar vs llguidance.

For a typical JSON schema and the embedded default's tokenizer (SmolLM2, 49152 tokens), it
compiles the schema, then walks the tokens of a valid instance through the matcher, timing
each ``fill_next_token_bitmask`` and each token acceptance.  Prints compile time and the
median / p90 per-token mask time (microseconds) for each engine.

    .venv/bin/python benchmarks/grammar_mask_cost.py [--model builtin:smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry"],
            "address": {"city": "London", "zip": "12345"}, "role": "admin"}


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"median {statistics.median(xs) * 1e6:7.1f} us  p90 {xs[int(0.9 * (len(xs) - 1))] * 1e6:7.1f} us  "
            f"max {xs[-1] * 1e6:7.1f} us")


def bench_xgrammar(tok, vocab_size: int, ids: list[int]) -> None:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    m = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, vocab_size)
    fill, acc = [], []
    for t in ids:
        a = time.perf_counter()
        m.fill_next_token_bitmask(bm, 0)
        b = time.perf_counter()
        assert m.accept_token(t), t
        c = time.perf_counter()
        fill.append(b - a)
        acc.append(c - b)
    logits = torch.randn(64, vocab_size)
    bm64 = bm.repeat(64, 1)
    a = time.perf_counter()
    for _ in range(20):
        xgr.apply_token_bitmask_inplace(logits, bm64)
    apply_s = (time.perf_counter() - a) / 20
    print(f"xgrammar {version('xgrammar')}: tokenizer info {t1 - t0:.2f} s, compile {1e3 * (t2 - t1):.1f} ms; "
          f"{len(ids)} tokens; mask: {_stats(fill)}; accept: {_stats(acc)}; apply [64, V] on CPU {apply_s * 1e6:.0f} us")


def bench_llguidance(tok, vocab_size: int, ids: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    t1 = time.perf_counter()
    grm = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(lltok, grm)
    t2 = time.perf_counter()
    assert not m.is_error(), m.get_error()
    bm = lgt.allocate_token_bitmask(1, vocab_size)
    fill, acc = [], []
    for t in ids:
        a = time.perf_counter()
        lgt.fill_next_token_bitmask(m, bm, 0)
        b = time.perf_counter()
        assert m.consume_token(t), (t, m.get_error())
        c = time.perf_counter()
        fill.append(b - a)
        acc.append(c - b)
    print(f"llguidance {version('llguidance')}: tokenizer {t1 - t0:.2f} s, compile {1e3 * (t2 - t1):.1f} ms; "
          f"{len(ids)} tokens; mask: {_stats(fill)}; accept: {_stats(acc)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2)")
    a = ap.parse_args()
    from kiln.runtime import loader

    tok = loader.load_tokenizer(loader.materialize_gguf(loader.resolve_source(a.model)))
    vocab = len(tok)
    ids = list(tok.encode(json.dumps(INSTANCE), add_special_tokens=False))
    print(f"vocabulary {vocab} tokens; instance {len(ids)} tokens")
    bench_xgrammar(tok, vocab, ids)
    bench_llguidance(tok, vocab, ids)


if __name__ == "__main__":
    main()
