"""The grammar bitmask filled on a worker thread while the step runs: the batch fill gives
xgrammar's per-row bitmasks, the persistent buffers are reused safely, the sampler applies a
compact mask (constrained rows only) exactly as the full one, and an engine gives the same
constrained outputs, each matching its grammar, synchronous, asynchronous (sampler launched
after the next step is planned) and with n-gram drafts for the unconstrained sequences."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from kiln.runtime.sampler import apply_token_bitmask, mask_logits_by_bits
from kiln.runtime.structured_output.bitmask import BitmaskFiller
from kiln.runtime.synthetic_tokenizer import build_tokenizer

VOCAB = 512
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = "[a-d]{2,5}-[0-9]{1,2}"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB, 1, [2])


@pytest.fixture(scope="module")
def compiled(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[2])
    comp = xgr.GrammarCompiler(info, max_threads=1)
    return comp.compile_json_schema(json.dumps(SCHEMA)), comp.compile_regex(REGEX)


def _matchers(compiled, prefixes):
    out = []
    for i, pre in enumerate(prefixes):
        m = xgr.GrammarMatcher(compiled[i % 2])
        assert m.accept_string(pre)
        out.append(m)
    return out


def test_batch_fill_matches_per_row_fill_and_reuses_buffers(compiled):
    filler = BitmaskFiller((VOCAB + 31) // 32, threads=2)
    prefixes = ["", "", '{"name": "a', "ab", '{"name": "ab", "n": 1', "abc-"]
    bufs = []
    for k in (1, 3, 6, 2, 6, 20):  # growing and shrinking batches, both slots in turn
        # one matcher per row, as each sequence has its own (the batch fill's threads fill
        # rows at once: a matcher in two rows would be filled from two threads)
        rows = _matchers(compiled, [prefixes[i % len(prefixes)] for i in range(k)])
        ids = [f"r{i}" for i in range(k)]
        mask = filler.start(ids, rows)
        got = mask.result().clone()
        assert mask.request_ids == ids and got.shape == (k, (VOCAB + 31) // 32)
        ref = torch.zeros_like(got)
        for i, m in enumerate(rows):
            m.fill_next_token_bitmask(ref, i)
        assert torch.equal(got, ref)
        assert mask.to_device(torch.device("cpu")).data_ptr() == mask.result().data_ptr()  # no copy on the CPU
        bufs.append(mask.result().data_ptr())
    assert len(set(bufs[:5])) == 2  # two persistent buffers, in turn, until one must grow (20 rows)
    assert filler.num_fills == 6 and filler.fill_seconds > 0 and filler.wait_seconds >= 0
    filler.shutdown()


@pytest.mark.parametrize("device_form", [False, True])
def test_compact_mask_equals_the_full_mask(device_form):
    g = torch.Generator().manual_seed(7)
    S, V = 6, 100
    W = (V + 31) // 32
    rows = [4, 1, 3]  # constrained logits rows, in the mask's order
    compact = torch.randint(-2**31, 2**31 - 1, (len(rows), W), dtype=torch.int32, generator=g)
    full = torch.full((S, W), -1, dtype=torch.int32)
    full[rows] = compact
    logits = torch.randn(S, V, generator=g)
    allowed = torch.zeros(S, V, dtype=torch.bool)
    for s in range(S):
        for t in range(V):
            allowed[s, t] = bool((int(full[s, t // 32]) >> (t % 32)) & 1)
    ref = logits.masked_fill(~allowed, float("-inf"))
    if device_form:  # the form CUDA runs, here on the CPU
        assert torch.equal(mask_logits_by_bits(logits.clone(), full), ref)
        return
    assert torch.equal(apply_token_bitmask(logits.clone(), compact, torch.tensor(rows)), ref)
    assert torch.equal(apply_token_bitmask(logits.clone(), full), ref)
    assert torch.isfinite(apply_token_bitmask(logits.clone(), compact, torch.tensor(rows))[[0, 2, 5]]).all()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    d = Path(tmp_path_factory.mktemp("tiny-so"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    tokenizer.save_pretrained(str(d))
    return str(d)


def _run(model: str, **kw):
    from kiln.runtime import SamplingParams
    from kiln.runtime.config import EngineArgs
    from kiln.runtime.engine import LLMEngine
    from kiln.runtime.sampling_params import StructuredOutputsParams as SO

    eng = LLMEngine(EngineArgs(model=model, load_format="dummy", seed=3, num_kv_blocks=64, block_size=8,
                               max_num_seqs=8, max_num_batched_tokens=64, **kw))
    eng.stream_outputs = False
    reqs = [
        (SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json=SCHEMA)), "json"),
        (SamplingParams(temperature=0.8, seed=4, max_tokens=40, structured_outputs=SO(json=SCHEMA)), "json"),
        (SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(regex=REGEX)), "regex"),
        (SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), None),  # unconstrained rows between
        (SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(choice=["alpha", "beta"])), "choice"),
        (SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), None),
    ]
    for i, (sp, _) in enumerate(reqs):
        eng.add_request(f"r{i}", [5 + i, 40, 41, 42] * (i + 1), sp)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
    filler = eng.core.grammars.manager.filler
    assert filler.num_fills > 0 and filler.fill_seconds > 0
    assert eng.core.grammars.manager.num_compiles == 3  # the two requests of one schema share a compile
    for i, (_, kind) in enumerate(reqs):
        _, text, reason = done[f"r{i}"]
        if kind is None or reason != "stop":
            continue
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in ("alpha", "beta")
    return done


def test_constrained_outputs_same_sync_async_and_with_drafts(tiny_model):
    sync = _run(tiny_model, async_scheduling=False)
    assert sum(reason == "stop" for _, _, reason in sync.values()) >= 3  # grammars ran to their end
    assert _run(tiny_model, async_scheduling=True) == sync
    assert _run(tiny_model, async_scheduling=False, speculative_method="ngram", num_speculative_tokens=3) == sync


def test_a_filler_lowers_the_switch_interval_so_its_worker_can_start_during_the_step():
    import sys

    from kiln.runtime.structured_output.bitmask import FILL_SWITCH_INTERVAL_S, BitmaskFiller

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        f = BitmaskFiller(8)
        assert sys.getswitchinterval() == pytest.approx(FILL_SWITCH_INTERVAL_S)
        sys.setswitchinterval(FILL_SWITCH_INTERVAL_S / 2)
        BitmaskFiller(8).shutdown()  # never raised again
        assert sys.getswitchinterval() == pytest.approx(FILL_SWITCH_INTERVAL_S / 2)
        f.shutdown()
    finally:
        sys.setswitchinterval(old)
