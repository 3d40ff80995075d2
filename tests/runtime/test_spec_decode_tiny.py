"""Speculative decoding on a tiny random Llama (CPU, float32): greedy parity across the batch
size above which speculation is switched off (and the proposers' catch-up when it is switched
on again), logprobs / stop strings / ``n = 2`` with the draft model and an EAGLE head, a
quantized ``kiln build`` engine of the target as the draft model, and ``kiln bench offline
--dataset copy``'s speculative summary.

Except for the fp8 engine, the draft model is the target itself (the same folder, loaded
twice): a greedy draft is then the target's own next token, so every draft must be accepted
and the draft's KV cache must hold the target's K/V wherever it has caught up."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.processing.output import child_id

VOCAB = 512
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}
K = 3  # drafts per step

# 10 prompts (token ids); the first two are long-running (their drafts resume once the other
# eight have finished), and repeat a pattern so that prompt lookup finds matches.
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(_rng.randrange(6, 14))] for _ in range(10)]
PROMPTS[0] = PROMPTS[0] * 3
PROMPTS[1] = PROMPTS[1] * 2
LONG, SHORT = 32, 6
PARAMS = [SamplingParams(temperature=0.0, max_tokens=LONG if i < 2 else SHORT, ignore_eos=True)
          for i in range(len(PROMPTS))]


def _write_tiny_llama(path: Path) -> Path:
    """A 2-layer random Llama (Hugging Face names, safetensors) with the synthetic tokenizer.
    Weights large enough that the greedy token wins by a clear margin (no float near-ties);
    the layers' outputs are smaller than the embedding, so that greedy text falls into
    repeated bigrams after a few dozen tokens (prompt lookup finds matches) while the next
    token still depends on the context (attention over the KV cache)."""
    from safetensors.torch import save_file

    from kiln.runtime.synthetic_tokenizer import build_tokenizer

    c = TINY_CONFIG
    g = torch.Generator().manual_seed(0)
    H, I, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D

    def rnd(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": rnd(VOCAB, H, std=1.0), "model.norm.weight": torch.ones(H),
         "lm_head.weight": rnd(VOCAB, H, std=0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
              p + "self_attn.q_proj.weight": rnd(q, H, std=0.3), p + "self_attn.k_proj.weight": rnd(kv, H, std=0.3),
              p + "self_attn.v_proj.weight": rnd(kv, H), p + "self_attn.o_proj.weight": rnd(H, q, std=0.05),
              p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
              p + "mlp.down_proj.weight": rnd(H, I, std=0.05)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    build_tokenizer(VOCAB, c["bos_token_id"], [c["eos_token_id"]]).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(_write_tiny_llama(tmp_path_factory.mktemp("spec-tiny") / "llama"))


@pytest.fixture(scope="module")
def eagle_head(tiny, tmp_path_factory) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from eagle_heads import write_random_head

    return str(write_random_head(tmp_path_factory.mktemp("spec-head"), TINY_CONFIG, "eagle"))


@pytest.fixture(scope="module")
def base(tiny):
    """The target without speculation (asynchronous scheduling on, as in the tests below)."""
    return _llm(tiny)


def _llm(tiny: str, **kw) -> LLM:
    args = dict(num_kv_blocks=128, max_num_batched_tokens=256, async_scheduling=True)
    if "speculative_method" in kw:  # a fixed switch-off size: every step drafts
        args["speculative_disable_by_batch_size"] = 8
    args.update(kw)
    return LLM(model=tiny, **args)


def _spec_kw(method: str, tiny: str, eagle_head: str) -> dict:
    model = {"ngram": None, "draft": tiny, "eagle": eagle_head}[method]
    return dict(speculative_method=method, num_speculative_tokens=K, speculative_model=model)


def _slots(llm: LLM, request_id: str, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) indices of a running sequence's first ``num_positions`` KV slots."""
    bs = llm.engine.runner.block_size
    blocks = llm.engine.scheduler.kv_cache_manager.get_block_ids(request_id)
    pos = torch.arange(num_positions)
    return torch.tensor(blocks)[pos // bs], pos % bs


# ---- switching speculation off above the batch threshold, and on again ------------------
class _Driver:
    """Steps an engine by hand, keeping the finished outputs; ``step()`` says whether the step
    drafted (a speculative step)."""

    def __init__(self, llm: LLM):
        self.llm, self.eng, self.spec = llm, llm.engine, llm.engine.core.spec
        self.final: dict = {}

    def add(self, prompts, params) -> list[str]:
        return [self.eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]

    def step(self) -> bool:
        before = self.spec.num_spec_steps
        for o in self.eng.step():
            if o.finished:
                self.final[o.request_id] = o
        return self.spec.num_spec_steps > before

    def head_k(self, req, num_positions: int) -> torch.Tensor:
        """The EAGLE head's cached keys at a running sequence's first positions."""
        blk, off = _slots(self.llm, req.request_id, num_positions)
        return self.spec.proposer.head.self_attn.attn.k_cache[blk, off].clone()


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_switch_off_above_the_batch_threshold_keeps_greedy_parity_and_catches_up(tiny, eagle_head, base, method):
    """``speculative_disable_by_batch_size=2``, asynchronous scheduling: the two long sequences
    draft, eight short ones join (no drafts while ten run; those steps are asynchronous), and
    once those have finished the two draft again.  Outputs are token-identical to decoding
    without speculation.  At the first step with drafts again the proposers have caught up on
    the tokens decoded meanwhile: the draft model's KV cache equals the target's at every
    verified position, and the EAGLE head's equals that of a run that never stopped drafting
    (every verified position's head K/V comes from the target's features)."""
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, PARAMS)]
    kw = _spec_kw(method, tiny, eagle_head)
    run = _Driver(_llm(tiny, speculative_disable_by_batch_size=2, enable_prefix_caching=False, **kw))
    eng, spec = run.eng, run.spec
    assert eng.async_scheduling and spec.config.max_batch_size == 2
    ids = run.add(PROMPTS[:2], PARAMS[:2])
    while spec.num_spec_steps < 3:
        assert run.step() or spec.num_spec_steps == 0  # the prefill step runs without drafts
    ids += run.add(PROMPTS[2:], PARAMS[2:])
    assert run.step()  # two running: a speculative step, which admits the eight short ones
    assert eng.scheduler.num_running == 10
    drafts_before, disabled_before = spec.stats.num_draft_tokens, spec.num_disabled_steps
    while not run.step():
        assert spec.stats.num_draft_tokens == drafts_before
    # the first step with drafts again: the two long sequences are left
    assert spec.num_disabled_steps - disabled_before >= SHORT - 1
    running = sorted(eng.scheduler.running, key=lambda r: r.request_id)
    assert [r.request_id for r in running] == sorted(child_id(i, 0) for i in ids[:2])
    resumed = {}
    for req in running:
        n = req.num_computed_tokens
        if method == "draft":
            # every verified position but possibly the last has the draft's K/V
            blk, off = _slots(run.llm, req.request_id, n - 1)
            for (tk, tv), (dk, dv) in zip(eng.runner.kv_caches, spec.proposer.runner.kv_caches):
                torch.testing.assert_close(dk[blk, off], tk[blk, off], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(dv[blk, off], tv[blk, off], rtol=1e-4, atol=1e-5)
        elif method == "eagle":
            # positions up to the target's last feature before this step's drafts
            resumed[req.prompt_token_ids[0]] = run.head_k(req, n - K - 1)
    while eng.has_unfinished_requests():
        run.step()
    assert [run.final[i].outputs[0].token_ids for i in ids] == want
    assert spec.stats.num_draft_tokens > drafts_before
    if method == "draft":
        assert spec.stats.acceptance_rate == 1.0
    assert eng.scheduler.kv_cache_manager.num_used_blocks == 0
    if method == "eagle":
        # drafts at every step: a fixed size, so the measured switch-off cannot turn them off
        ref = _Driver(_llm(tiny, enable_prefix_caching=False, speculative_disable_by_batch_size=8, **kw))
        ref.add(PROMPTS[:2], PARAMS[:2])
        last = {}
        while ref.eng.has_unfinished_requests():
            ref.step()
            for req in ref.eng.scheduler.running:
                last[req.prompt_token_ids[0]] = ref.head_k(req, req.num_computed_tokens - K - 1)
        assert ref.spec.num_disabled_steps == 0 and len(resumed) == 2
        for first, got in resumed.items():
            assert last[first].shape[0] > got.shape[0]
            torch.testing.assert_close(got, last[first][: got.shape[0]], rtol=1e-4, atol=1e-5)


# ---- logprobs, stop strings, n = 2 with the model-based proposers -------------------------
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_model_proposers_keep_logprobs_stop_strings_and_n(tiny, eagle_head, base, method):
    llm = _llm(tiny, **_spec_kw(method, tiny, eagle_head))
    stats = llm.engine.core.spec.stats
    prompts = PROMPTS[:3]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)
    want, got = base.generate(prompts, greedy), llm.generate(prompts, greedy)
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == 16
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
            assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-4)
    assert stats.num_draft_tokens > 0
    if method == "draft":
        assert stats.acceptance_rate == 1.0  # the verified runs are K + 1 tokens long
    # a stop string in the middle of the greedy text: the same text, cut at the same place
    text = want[0].outputs[0].text
    stop_at = next(i for i in range(8, len(text) - 2) if text[i:i + 2].isalnum())
    stop = SamplingParams(temperature=0.0, max_tokens=16, stop=[text[stop_at:stop_at + 2]], ignore_eos=True)
    w, g = base.generate([prompts[0]], stop)[0].outputs[0], llm.generate([prompts[0]], stop)[0].outputs[0]
    assert g.text == w.text == text[:text.index(text[stop_at:stop_at + 2])]
    assert g.finish_reason == w.finish_reason == "stop"
    # n = 2, greedy: both completions are the greedy one
    two = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)
    outs = llm.generate(prompts[:2], two)
    for o, w in zip(outs, want):
        assert [c.token_ids for c in o.outputs] == [w.outputs[0].token_ids[:12]] * 2
    # n = 2, sampled and seeded: reproducible run to run, each completion its own stream
    sampled = SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=7, ignore_eos=True)
    before = stats.num_draft_tokens, stats.num_accepted_tokens
    a = [c.token_ids for c in llm.generate([prompts[0]], sampled)[0].outputs]
    b = [c.token_ids for c in llm.generate([prompts[0]], sampled)[0].outputs]
    assert a == b and len(a) == 2 and all(len(t) == 12 for t in a) and a[0] != a[1]
    assert stats.num_draft_tokens > before[0]
    if method == "draft":
        # drafts drawn from the target's own distribution: the rejection sampler keeps them
        assert (stats.num_accepted_tokens - before[1]) / (stats.num_draft_tokens - before[0]) > 0.9


# ---- a quantized engine of the target as the draft model ---------------------------------
def test_fp8_engine_of_the_target_as_the_draft_model(tiny, base, tmp_path, capsys):
    from kiln.runtime.cli import main

    engine = tmp_path / "fp8"
    # two calibration samples (of 128 by default) keep the build to seconds
    assert main(["build", "--model", tiny, "--output", str(engine), "--quantization", "fp8",
                 "--calibration-samples", "2"]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((engine / "manifest.json").read_text())["quantization"]["method"] == "fp8"
    llm = _llm(tiny, speculative_method="draft", num_speculative_tokens=K, speculative_model=str(engine))
    draft = llm.engine.core.spec.proposer.runner.model
    assert any(t.dtype == torch.float8_e4m3fn for t in draft.state_dict().values())  # the engine's fp8 weights
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS[:4], sp)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], sp)] == want
    stats = llm.engine.core.spec.stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.5, stats


# ---- kiln bench offline --dataset copy ---------------------------------------------------
def test_bench_offline_copy_prints_the_spec_metrics(tiny, tmp_path, capsys):
    from kiln.runtime.cli import main

    out = tmp_path / "r.json"
    rc = main(["bench", "offline", "--model", tiny, "--device", "cpu", "--num-kv-blocks", "256",
               "--dataset", "copy", "--num-prompts", "2", "--input-len", "24", "--output-len", "10",
               "--speculative-method", "draft", "--speculative-model", tiny, "--num-speculative-tokens", "3",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text[-2000:]
    r = json.loads(out.read_text())["results"][0]
    assert r["output_tokens"] == 20 and r["spec_method"] == "draft" and r["spec_k"] == 3
    # the draft is the target: every draft accepted, at every position
    assert r["spec_draft_tokens"] > 0 and r["spec_accepted_tokens"] == r["spec_draft_tokens"]
    assert r["spec_acceptance_rate"] == 1.0 and r["spec_acceptance_per_position"] == [1.0, 1.0, 1.0]
    assert r["spec_mean_accepted_length"] == pytest.approx(1 + r["spec_draft_tokens"] / r["spec_num_drafts"])
    line = next(ln for ln in text.splitlines() if ln.startswith("speculative "))
    assert line == (f"speculative draft k=3 (drafts where measured to pay up to 8 sequences): acceptance 1.000, "
                    f"mean accepted length {r['spec_mean_accepted_length']:.2f} tokens, per position "
                    f"[1.00 1.00 1.00], {r['spec_draft_tokens']} draft tokens in {r['spec_num_drafts']} verifications")
    assert r["spec_adaptive"] and r["spec_switch_off_rates"]["1-1"]["speculative"] > 0
    rates = next(ln for ln in text.splitlines() if ln.startswith("output tok/s with vs without drafts"))
    assert "1-1: " in rates


class _EagerVerifyGraph:
    """On the CPU, where no CUDA graph is captured: ``replay()`` makes the call a captured
    multi-token graph would replay (the model over the persistent inputs) into its output."""

    def __init__(self, graphs, bs: int):
        rows = bs * graphs.verify_len
        self.replay = lambda: graphs.verify_outputs[bs].copy_(
            graphs.runner.model(graphs.input_ids[:rows], graphs.positions[:rows], graphs.verify_metadata(bs)))


class _EagerDecodeGraph:
    """The CPU stand-in of a one-token decode graph of ``bs`` rows."""

    def __init__(self, graphs, bs: int):
        self.replay = lambda: graphs.outputs[bs].copy_(
            graphs.runner.model(graphs.input_ids[:bs], graphs.positions[:bs], graphs.metadata(bs)))


def test_draft_catch_up_through_the_multi_token_graph_inputs(tiny, base):
    """The draft model's catch-up forwards (the tokens verified since its last step, up to
    k + 1 per sequence) staged through its multi-token graph inputs
    (``DecodeGraphs.run_verify_rows``: rows packed per sequence, query start offsets, padding),
    and its one-token forwards through the decode graph inputs with each draft read from the
    device (``DecodeGraphs.run_rows`` given a tensor), give the eager drafts: every draft
    accepted, outputs equal plain decoding."""
    from kiln.runtime.decode_graphs import DecodeGraphs

    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, PARAMS)]
    llm = _llm(tiny, speculative_method="draft", num_speculative_tokens=K, speculative_model=tiny,
               speculative_disable_by_batch_size=16)
    runner = llm.engine.core.spec.proposer.runner
    g = DecodeGraphs(runner, 16, llm.engine.max_model_len, verify_len=K + 1, verify_max_seqs=16)
    for bs in g.verify_sizes:
        g.verify_outputs[bs] = torch.empty(bs * g.verify_len, TINY_CONFIG["hidden_size"], dtype=runner.dtype)
        g.verify_graphs[bs] = _EagerVerifyGraph(g, bs)
    replays = []
    for bs in g.sizes:
        g.outputs[bs] = torch.empty(bs, TINY_CONFIG["hidden_size"], dtype=runner.dtype)
        g.graphs[bs] = _EagerDecodeGraph(g, bs)
        g.graphs[bs].replay = (lambda f: lambda: (replays.append(1), f()))(g.graphs[bs].replay)
    runner.decode_graphs = g
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        runner.decode_graphs = None
    assert g.num_verify_replays > 0 and replays
    assert llm.engine.core.spec.stats.acceptance_rate == 1.0
    assert got == want
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def _record_drafts(llm: LLM) -> list[list[list[int]]]:
    """Every step's drafts (per drafting sequence, in schedule order), recorded as proposed."""
    prop, seen = llm.engine.core.spec.proposer, []
    propose = prop.propose

    def recording(out, rows):
        probs = propose(out, rows)
        seen.append([list(sr.spec_token_ids) for sr in out.scheduled if sr.num_spec_tokens])
        return probs

    prop.propose = recording
    return seen


def test_eagle_head_steps_through_the_graph_inputs_give_the_eager_drafts(tiny, eagle_head, base):
    """An EAGLE head's one-token steps staged as their CUDA graphs read them
    (``EagleHeadGraphs.run``: the target's decode-graph inputs, each draft read from the
    device, the features in the head's own buffer, padded rows) propose exactly the drafts of
    the eager head steps, step by step, and outputs equal plain decoding.  On the CPU the
    captured call is made eagerly (the GPU test in test_verify_graphs.py replays real graphs)."""
    from kiln.runtime.decode_graphs import DecodeGraphs
    from kiln.runtime.spec_decode.eagle_graphs import EagleHeadGraphs

    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, PARAMS)]
    kw = dict(speculative_method="eagle", num_speculative_tokens=K, speculative_model=eagle_head,
              speculative_disable_by_batch_size=16)
    eager = _llm(tiny, **kw)
    assert eager.engine.core.spec.proposer.graphs is None  # no decode graphs on the CPU
    want_drafts = _record_drafts(eager)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, PARAMS)] == want
    llm = _llm(tiny, **kw)
    prop, runner = llm.engine.core.spec.proposer, llm.engine.runner
    runner.decode_graphs = DecodeGraphs(runner, 16, llm.engine.max_model_len)
    hg = EagleHeadGraphs(prop.head, runner, 16)
    assert hg.sizes == [1, 2, 4, 8, 16]
    for bs in hg.sizes:
        hg.outputs[bs] = (torch.empty(bs, VOCAB), torch.empty(bs, TINY_CONFIG["hidden_size"]))
        hg.graphs[bs] = _EagerHeadGraph(hg, bs)
    prop.graphs = hg
    got_drafts = _record_drafts(llm)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        runner.decode_graphs = None
    assert hg.num_replays > 0
    assert got_drafts == want_drafts and sum(len(d) for step in got_drafts for d in step) > 0
    assert got == want
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


class _EagerHeadGraph:
    """The CPU stand-in of an EAGLE head step's graph of ``bs`` rows."""

    def __init__(self, graphs, bs: int):
        def replay():
            logits, nxt = graphs.step(bs)
            graphs.outputs[bs][0].copy_(logits)
            graphs.outputs[bs][1].copy_(nxt)

        self.replay = replay


# ---- a draft or head that cannot serve: one ValueError naming the speculative model -----
def test_bad_speculative_models_are_refused_with_what_is_wrong(tiny, tmp_path, caplog):
    """A corrupt EAGLE weights file, an EAGLE config.json that is no JSON, a draft whose
    context is shorter than the served one, and a draft of the target's vocabulary size whose
    tokenizer spells other tokens: each a ValueError that names the speculative model and the
    fault (``kiln serve`` turns it into one line and exit 2)."""
    import shutil

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(TINY_CONFIG))
    (head / "model.safetensors").write_bytes(b"garbage\n")
    with pytest.raises(ValueError, match=r"speculative model .*head: the EAGLE head's weights cannot be read"):
        _llm(tiny, speculative_method="eagle", speculative_model=str(head))
    (head / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"speculative model .*head: the EAGLE head's config.json: cannot be read"):
        _llm(tiny, speculative_method="eagle", speculative_model=str(head))

    short = tmp_path / "short"
    shutil.copytree(tiny, short)
    (short / "config.json").write_text(json.dumps(dict(TINY_CONFIG, max_position_embeddings=64)))
    with pytest.raises(ValueError, match=r"speculative model .*short: max_model_len 128 is larger than the model's"):
        _llm(tiny, max_model_len=128, speculative_method="draft", speculative_model=str(short))

    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    names = sorted((t for t, i in vocab.items() if 300 <= i < 400), key=vocab.get)
    for t, i in zip(names, reversed([vocab[t] for t in names])):  # the same tokens, other ids
        vocab[t] = i
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"speculative model .*other: 100 of its 512 token ids spell other tokens"):
        _llm(tiny, speculative_method="draft", speculative_model=str(other))
    # two ids swapped (renamed special tokens, say): served, with a warning
    few = tmp_path / "few"
    shutil.copytree(tiny, few)
    tok = json.loads((tiny_tok := Path(tiny) / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (few / "tokenizer.json").write_text(json.dumps(tok))
    assert tiny_tok.read_text() != (few / "tokenizer.json").read_text()
    with caplog.at_level("WARNING", logger="kiln.runtime.spec_decode.draft"):
        _llm(tiny, speculative_method="draft", speculative_model=str(few))
    assert "2 token ids spell other tokens than the target's" in caplog.text
