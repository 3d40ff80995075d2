"""Speculative decoding: the n-gram proposer, the scheduler's rollback of rejected drafts, the
rejection sampler's distribution (chi-square), and greedy parity with decoding without drafts
on the embedded default model (one by one, batched, with preemption forced)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.core.config import SchedulerConfig
from kiln.runtime.core.request import Request
from kiln.runtime.core.scheduler import Scheduler
from kiln.runtime.spec_decode.config import SpeculativeConfig
from kiln.runtime.spec_decode.ngram import NgramProposer, ngram_propose
from kiln.runtime.spec_decode.stats import SpecDecodeStats

# A copy-heavy prompt: the answer repeats most of the given text.
COPY_TEXT = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs "
             "into the green forest to find its friends.")
COPY_PROMPTS = [
    f"Repeat the following text exactly.\nText: {COPY_TEXT}\nRepeated text: {COPY_TEXT[:40]}",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# the same two functions again\n"
    "def add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4,",
    "The capital of France is",
]


# ---- n-gram proposer --------------------------------------------------------------------
def test_ngram_proposes_continuation_of_most_recent_longest_match():
    toks = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3], dtype=np.int64)
    # suffix [2, 3] last occurred at 5..6 -> proposes what followed: 5, 6, 7
    assert ngram_propose(toks, 3, 2, 4) == [5, 6, 7]
    # the longer suffix [7, 2, 3] never occurred before; min 3 -> no draft
    assert ngram_propose(toks, 3, 3, 4) == []
    # the continuation is cut at the end of the sequence
    assert ngram_propose(np.array([5, 6, 5, 6], dtype=np.int64), 4, 2, 2) == [5, 6]
    p = NgramProposer(4, 2, 5)
    assert p.propose([1, 2]) == []  # too short to match anything
    assert p.propose([8, 1, 2, 3, 8, 1], k=2) == [2, 3]


def _ngram_by_definition(toks: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup spelled out: for n from n_max down to n_min, the latest earlier start i
    with toks[i:i+n] equal to the last n tokens; what followed it."""
    L = len(toks)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if toks[i:i + n] == toks[L - n:]:
                return toks[i + n:i + n + k]
    return []


def test_ngram_search_equals_its_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        L, vocab = int(rng.integers(1, 50)), int(rng.integers(2, 6))  # small vocabularies: many matches
        toks = rng.integers(0, vocab, L).astype(np.int64)
        n_min = int(rng.integers(1, 4))
        n_max, k = int(rng.integers(n_min, 7)), int(rng.integers(1, 6))
        assert ngram_propose(toks, k, n_min, n_max) == _ngram_by_definition(toks.tolist(), k, n_min, n_max), \
            (toks.tolist(), k, n_min, n_max)


def test_speculative_config_refuses_bad_settings():
    for kw in ({"method": "medusa"}, {"method": "ngram", "num_speculative_tokens": 0},
               {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3},
               {"method": "draft"}, {"method": "ngram", "model": "builtin:x"},
               {"method": "ngram", "disable_by_batch_size": 0}):
        with pytest.raises(ValueError):
            SpeculativeConfig(**kw)
    assert SpeculativeConfig("ngram", disable_by_batch_size=3).max_batch_size == 3


def test_stats_count_per_position():
    s = SpecDecodeStats()
    s.observe(3, 1)
    s.observe(2, 2)
    assert s.acceptance_per_position() == [1.0, 0.5, 0.0]
    assert s.acceptance_rate == 3 / 5 and s.mean_accepted_length == 1 + 3 / 2


# ---- scheduler rollback -----------------------------------------------------------------
def _sched(num_blocks=16, bs=4, **kw):
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=bs,
                                     num_kv_blocks=num_blocks, **kw))


def test_drafts_are_scheduled_and_rejected_slots_rolled_back():
    s = _sched()
    kv = s.kv_cache_manager
    r = Request("a", list(range(10, 16)), max_tokens=20)  # 6 prompt tokens
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"a": 100})  # prefill -> 7 tokens, 6 computed, 2 blocks
    r.spec_token_ids = [101, 102, 103, 104, 105]
    out = s.schedule(async_step=False)
    sr = out.scheduled[0]
    assert sr.spec_token_ids == [101, 102, 103, 104, 105] and sr.num_new_tokens == 6 and out.num_spec_tokens == 5
    assert sr.needs_sample and sr.is_decode and r.spec_token_ids == []
    assert kv.num_blocks_held("a") == 3  # 12 positions of KV: 6 computed + 6 this step
    # the target accepts 101 and corrects the second draft to 7: run [101, 7]
    s.update_from_output(out, {"a": [101, 7]})
    assert r.output_token_ids == [100, 101, 7] and r.num_computed_tokens == 8
    assert kv.num_blocks_held("a") == 2  # block 3 held only rejected drafts: returned
    kv.check_invariants()
    # only fully verified blocks are cached: block 0 (tokens 0-3) and 1 (4-7), not the drafts
    assert kv.num_cached_blocks == 2
    blocks, hit = kv.get_computed_blocks(Request("b", list(range(10, 16)) + [100, 101, 7, 103], max_tokens=1))
    assert hit == 8
    s.finish_request("a", __import__("kiln.runtime.core.request", fromlist=["RequestStatus"]).RequestStatus.FINISHED_STOPPED)
    kv.check_invariants()
    assert kv.num_used_blocks == 0


def test_drafts_capped_by_max_tokens_and_budget_and_dropped_when_no_room():
    s = _sched(num_blocks=3)
    r = Request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=4)
    s.add_request(r)
    s.update_from_output(s.schedule(), {"a": 9})
    r.spec_token_ids = [1, 2, 3, 4, 5]
    out = s.schedule(async_step=False)
    # max_tokens 4, 1 generated: at most 2 drafts (the run's own token is the 4th)
    assert out.scheduled[0].spec_token_ids == [1, 2]
    s.update_from_output(out, {"a": [1, 2, 3]})
    assert r.num_output_tokens == 4 and r.num_computed_tokens == 10
    s2 = _sched(num_blocks=4)
    a, b = Request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=8), Request("b", list(range(8)), max_tokens=1)
    s2.add_request(a)
    s2.add_request(b)
    s2.update_from_output(s2.schedule(), {"a": 9, "b": 9})  # 2 blocks each; b waits to be finished
    a.spec_token_ids = [4, 5]
    out = s2.schedule(async_step=False)
    # positions 7-9 would need a fifth block: the drafts are dropped, nothing is preempted
    assert [(sr.request_id, sr.spec_token_ids, sr.num_new_tokens) for sr in out.scheduled] == [("a", [], 1)]
    assert not out.preempted_request_ids


def test_synchronous_step_with_a_step_in_flight_is_refused():
    s = _sched(async_scheduling=True)
    s.add_request(Request("a", [1, 2, 3], max_tokens=5))
    s.schedule()  # in flight: a placeholder waits
    with pytest.raises(RuntimeError):
        s.schedule(async_step=False)


# ---- rejection sampling follows the target distribution ----------------------------------
CHI2_CRIT_DF7_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = probs * counts.sum()
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was sampled"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["point-mass-drafts", "draft-distribution"])
def test_rejection_sampling_preserves_target_distribution(with_draft_probs):
    import torch

    from kiln.runtime.rejection_sampler import verify_on_device
    from kiln.runtime.sampler import SamplingRow
    from kiln.runtime.sampling_params import SamplingParams

    V, N, k = 8, 20000, 2
    g = torch.Generator().manual_seed(0)
    target = torch.randn(k + 1, V, generator=g) * 1.5  # logits after the context, d1, d2
    draft_q = torch.softmax(torch.randn(k, V, generator=g), dim=-1)
    params = SamplingParams(temperature=0.7, top_k=6)
    # drafts: drawn from q (draft model) or a fixed guess (n-gram)
    if with_draft_probs:
        d = torch.multinomial(draft_q, N, replacement=True, generator=g).T  # [N, k]
    else:
        d = target[:k].argmax(dim=-1).unsqueeze(0).expand(N, k)  # the likeliest guesses
    drafts = d.tolist()
    logits = target.repeat(N, 1).clone()
    rows = [SamplingRow(params, [1], [], None) for _ in range(N)]
    torch.manual_seed(1)
    res = verify_on_device(logits, rows, drafts, [draft_q] * N if with_draft_probs else None).materialize()
    # the target's sampler distribution: temperature then top-k
    from kiln.runtime.sampler import _filter

    p = [_filter(target[j].clone(), params).numpy() for j in range(k + 1)]
    first = np.bincount([t[0] for t in res.token_ids], minlength=V)
    assert _chi2(first, p[0]) < CHI2_CRIT_DF7_P001
    # given the first token equals the first draft, the second follows p_1 (and the third p_2)
    second = np.bincount([t[1] for t, dd in zip(res.token_ids, drafts) if t[0] == dd[0] and len(t) > 1],
                         minlength=V)
    assert second.sum() > 1000 and _chi2(second, p[1]) < CHI2_CRIT_DF7_P001
    assert all(1 <= len(t) <= k + 1 for t in res.token_ids)


def test_greedy_verification_accepts_while_argmax_agrees():
    import torch

    from kiln.runtime.rejection_sampler import verify_on_device
    from kiln.runtime.sampler import SamplingRow
    from kiln.runtime.sampling_params import SamplingParams

    logits = torch.full((4, 6), -5.0)
    for j, t in enumerate([2, 4, 1, 3]):
        logits[j, t] = 5.0
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [0], [], None)
    res = verify_on_device(logits.clone(), [row], [[2, 4, 0]]).materialize()
    assert res.token_ids == [[2, 4, 1]] and res.num_accepted == [2]
    assert len(res.logprobs[0]) == 3 and res.logprobs[0][2][1][0][0] == 1
    res = verify_on_device(logits.clone(), [row], [[2, 4, 1]]).materialize()
    assert res.token_ids == [[2, 4, 1, 3]] and res.num_accepted == [3]


# ---- greedy parity on the embedded default model ------------------------------------------
@pytest.fixture(scope="module")
def baseline():
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(num_kv_blocks=64, max_num_batched_tokens=128)
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    return [o.outputs[0].token_ids for o in llm.generate(COPY_PROMPTS, sp)]


def _spec_llm(**kw):
    from kiln.runtime import LLM

    # a fixed switch-off size: every step drafts (the measured switch-off has its own tests)
    base = dict(speculative_method="ngram", num_speculative_tokens=4, num_kv_blocks=64, max_num_batched_tokens=128,
                speculative_disable_by_batch_size=8)
    base.update(kw)
    return LLM(**base)


def test_ngram_greedy_parity_one_by_one_batched_and_preempted(baseline):
    from kiln.runtime import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=24)
    llm = _spec_llm()
    for prompt, want in zip(COPY_PROMPTS, baseline):
        assert llm.generate([prompt], sp)[0].outputs[0].token_ids == want
    stats = llm.engine.core.spec.stats
    assert stats.num_accepted_tokens > 0  # the copy prompts do accept drafts
    assert [o.outputs[0].token_ids for o in llm.generate(COPY_PROMPTS, sp)] == baseline
    # a pool too small for all four: requests are preempted and recomputed
    small = _spec_llm(num_kv_blocks=9, max_num_batched_tokens=64, enable_prefix_caching=False)
    outs = small.generate(COPY_PROMPTS, sp)
    assert small.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert small.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_measured_switch_off_alternating_modes_keeps_parity_seeds_and_frees_blocks(baseline, monkeypatch):
    """The default switch-off (no ``speculative_disable_by_batch_size``) compares measured
    rates; with probes after every step (``PROBE_SHARE`` 1, one step between probes) the
    engine alternates between steps with and without drafts at one batch size, asynchronous
    scheduling on.  Greedy outputs equal decoding without drafts, batched and one by one; a
    seeded sampled request gives the same tokens twice (its drafts do not depend on the
    timing); every KV block is freed; ``kiln bench``'s summary reports both measured rates."""
    from kiln.runtime import SamplingParams
    from kiln.runtime.bench import spec_summary
    from kiln.runtime.spec_decode import switch_off

    monkeypatch.setattr(switch_off, "PROBE_SHARE", 1.0)
    monkeypatch.setattr(switch_off, "MIN_STEPS_BETWEEN_PROBES", 1)
    monkeypatch.setattr(switch_off, "PROBE_STEPS", 2)
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    llm = _spec_llm(speculative_disable_by_batch_size=None, async_scheduling=True)
    spec = llm.engine.core.spec
    assert spec.switch_off.adaptive and llm.engine.async_scheduling
    assert [o.outputs[0].token_ids for o in llm.generate(COPY_PROMPTS, sp)] == baseline
    for prompt, want in zip(COPY_PROMPTS, baseline):
        assert llm.generate([prompt], sp)[0].outputs[0].token_ids == want
    assert spec.num_spec_steps > 0 and spec.num_disabled_steps > 0
    rates = spec_summary(llm)["spec_switch_off_rates"]
    assert rates["1-1"]["speculative"] > 0 and rates["1-1"]["plain"] > 0
    assert rates["3-4"]["speculative"] > 0 and rates["3-4"]["plain"] > 0
    seeded = SamplingParams(temperature=0.8, max_tokens=20, seed=11)
    first = llm.generate([COPY_PROMPTS[0]] * 2, seeded)
    again = llm.generate([COPY_PROMPTS[0]] * 2, seeded)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_where_drafts_are_measured_to_lose_only_seeded_sampled_requests_draft():
    """The measured switch-off says no at batch sizes 1 and 2 (plain decoding measured 10x
    faster): a greedy request and an unseeded sampled one decode without drafts; a seeded
    sampled request still drafts (alone), so its tokens do not depend on step timing."""
    from kiln.runtime import SamplingParams
    from kiln.runtime.spec_decode.switch_off import _Bucket

    llm = _spec_llm(speculative_disable_by_batch_size=None)
    spec = llm.engine.core.spec
    for index in (0, 1):
        b = spec.switch_off.buckets.setdefault(index, _Bucket())
        b.spec.add(1, 1.0)
        b.plain.add(10, 1.0)
    llm.generate([COPY_PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20))
    llm.generate([COPY_PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=20))
    assert spec.stats.num_draft_tokens == 0 and spec.num_disabled_steps > 0
    llm.generate([COPY_PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=20, seed=3))
    assert spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["draft", "eagle", "eagle3"])
def test_model_proposers_greedy_parity_async_and_prefix_cached(baseline, method, tmp_path):
    """The draft model (here the target itself: every draft is accepted) and random EAGLE /
    EAGLE-3 heads (nearly none is): outputs equal decoding without drafts, with asynchronous
    scheduling on, the first prompt's prefix cached by a first pass and preemption forced."""
    import sys
    from pathlib import Path

    from kiln.runtime import SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from eagle_heads import write_random_head

    if method == "draft":
        kw = dict(speculative_method="draft", speculative_model="builtin:smollm2-135m-instruct")
    else:
        from kiln.runtime import loader

        tcfg = loader.load_model_config(loader.materialize_gguf(loader.resolve_source(None))).to_hf_dict()
        kw = dict(speculative_method="eagle", speculative_model=str(write_random_head(tmp_path, tcfg, method)))
    # 7 blocks of 16 tokens: both prompts are admitted (4 + 3 blocks), then cannot both grow
    llm = _spec_llm(num_speculative_tokens=3, async_scheduling=True, num_kv_blocks=7, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    want = [b[:12] for b in baseline[:2]]
    assert llm.generate(COPY_PROMPTS[:1], sp)[0].outputs[0].token_ids == want[0]
    # batched; the first prompt's blocks are now prefix-cache hits
    assert [o.outputs[0].token_ids for o in llm.generate(COPY_PROMPTS[:2], sp)] == want
    assert llm.engine.scheduler.num_preemptions_total > 0
    stats = llm.engine.core.spec.stats
    assert stats.num_draft_tokens > 0
    if method == "draft":
        assert stats.acceptance_rate == 1.0
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_ngram_keeps_logprobs_stop_strings_n_and_seeds():
    from kiln.runtime import LLM, SamplingParams

    base = LLM(num_kv_blocks=64, max_num_batched_tokens=128)
    spec = _spec_llm()
    prompt = COPY_PROMPTS[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)
    want, got = base.generate([prompt], greedy)[0].outputs[0], spec.generate([prompt], greedy)[0].outputs[0]
    assert got.token_ids == want.token_ids and spec.engine.core.spec.stats.num_accepted_tokens > 0
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    # a stop string inside a verified run ends the text there, as without drafts
    stop = SamplingParams(temperature=0.0, max_tokens=24, stop=["lazy"])
    assert spec.generate([prompt], stop)[0].outputs[0].text == base.generate([prompt], stop)[0].outputs[0].text
    # sampled, n = 2, seeded: reproducible run to run
    sampled = SamplingParams(temperature=0.8, max_tokens=20, n=2, seed=7)
    a = [c.token_ids for c in spec.generate([prompt], sampled)[0].outputs]
    b = [c.token_ids for c in spec.generate([prompt], sampled)[0].outputs]
    assert a == b and len(a) == 2 and all(len(t) == 20 for t in a)


def test_cli_flags_reach_engine_args_and_bad_ones_exit_2(capsys):
    from kiln.runtime.cli import build_parser, engine_args_from, main

    ns = build_parser().parse_args(["serve", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                                    "--prompt-lookup-min", "1", "--prompt-lookup-max", "4",
                                    "--speculative-disable-by-batch-size", "2"])
    spec = engine_args_from(ns).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.max_batch_size) == ("ngram", 3, 1, 4, 2)
    ns = build_parser().parse_args(["bench", "offline", "--speculative-method", "draft", "--speculative-model", "x"])
    assert engine_args_from(ns).speculative.model == "x"
    assert main(["serve", "--port", "0", "--speculative-method", "draft"]) == 2
    assert "needs --speculative-model" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--num-speculative-tokens", "3"]) == 2


def test_metrics_expose_spec_decode_counters():
    from kiln.runtime.engine_core.core import StepStats
    from kiln.runtime.server.metrics import Metrics

    m = Metrics("m")
    s = SpecDecodeStats()
    s.observe(3, 2)
    st = dict(num_prompt_tokens=0, num_cached_prompt_tokens=0, num_generation_tokens=3, num_scheduled_tokens=0,
              num_running=1, num_waiting=0, kv_cache_usage=0.1, num_preemptions_total=0, prefix_cache_queries=0,
              prefix_cache_hits=0)
    m.on_step(StepStats(**st, spec_decode=s))
    s.observe(3, 0)
    m.on_step(StepStats(**st, spec_decode=s, spec_switch_off={"1-1": {"speculative": 250.0, "plain": 180.0},
                                                              "2-2": {"speculative": None, "plain": 300.0}}))
    text = m.render().decode()
    rate = 'kiln_spec_decode_output_tokens_per_second{batch_sizes="%s",mode="%s",model_name="m"} %s'
    assert rate % ("1-1", "speculative", "250.0") in text and rate % ("1-1", "plain", "180.0") in text
    assert rate % ("2-2", "plain", "300.0") in text and 'batch_sizes="2-2",mode="speculative"' not in text
    assert 'kiln_spec_decode_num_draft_tokens_total{model_name="m"} 6.0' in text
    assert 'kiln_spec_decode_num_accepted_tokens_total{model_name="m"} 2.0' in text
    assert 'kiln_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert 'kiln_spec_decode_mean_accepted_length{model_name="m"} 2.0' in text


# ---- grammars over draft positions ------------------------------------------------------
def test_draft_rows_are_the_grammar_after_each_draft_and_leave_the_state_unchanged():
    """``fill_draft_rows``: row j is what a fresh matcher allows after drafts 1..j; after a
    refused draft the rows are all ones; the matcher ends where it began."""
    import torch
    import xgrammar as xgr

    from kiln.runtime.structured_output.backend import GrammarCompilerCache, GrammarState, bitmask_width
    from kiln.runtime.structured_output.bitmask import fill_draft_rows
    from kiln.runtime.structured_output.spec import GrammarSpec
    from kiln.runtime.synthetic_tokenizer import build_tokenizer

    tok = build_tokenizer(4096, 1, [2])
    cache = GrammarCompilerCache(tok, 4096, [2])
    compiled = cache.get(GrammarSpec("regex", "(ab|cd)[0-9]{2}x"))
    ids = [tok.convert_tokens_to_ids(c) for c in "abcd0123x"]
    a, b, c, d, zero, one, two, three, x = ids
    W = bitmask_width(4096)

    def expect(prefix):
        m = xgr.GrammarMatcher(compiled)
        for t in prefix:
            assert m.accept_token(t)
        out = torch.zeros((1, W), dtype=torch.int32)
        m.fill_next_token_bitmask(out, 0)
        return out[0]

    st = GrammarState(compiled)
    assert st.accept_token(a)
    before = expect([a])
    for drafts, legal in [([b, one, two, x], 4), ([b, one, d, x], 2), ([c], 0), ([b, one], 2)]:
        buf = torch.zeros((len(drafts) + 1, W), dtype=torch.int32)
        fill_draft_rows(st.matcher, drafts, buf, 0)
        for j in range(len(drafts) + 1):
            if j <= legal:
                assert torch.equal(buf[j], expect([a] + drafts[:j])), (drafts, j)
            else:
                assert (buf[j] == -1).all(), (drafts, j)
        probe = torch.zeros((1, W), dtype=torch.int32)
        st.fill_bitmask(probe, 0)
        assert torch.equal(probe[0], before) and st.num_accepted == 1  # rolled back


def test_verification_under_a_bitmask_rejects_drafts_outside_the_grammar():
    import torch

    from kiln.runtime import SamplingParams
    from kiln.runtime.rejection_sampler import verify_on_device
    from kiln.runtime.sampler import SamplingRow

    V = 64
    logits = torch.zeros((4, V))
    logits[:, 5] = 10.0  # the unconstrained argmax everywhere
    logits[:, 7] = 5.0
    bitmask = torch.full((4, 2), -1, dtype=torch.int32)
    bitmask[2, 0] &= ~(1 << 5)  # position 2 forbids token 5
    greedy = SamplingRow(SamplingParams(temperature=0.0), [1], [], None, None)
    res = verify_on_device(logits.clone(), [greedy], [[5, 5, 5]], None, bitmask).materialize()
    assert res.token_ids == [[5, 5, 7]] and res.num_accepted == [2]  # the third draft is illegal
    sampled = SamplingRow(SamplingParams(temperature=1.0), [1], [], None, None)
    for _ in range(20):
        res = verify_on_device(logits.clone(), [sampled], [[5, 5, 5]], None, bitmask).materialize()
        run = res.token_ids[0]
        assert len(run) <= 3 or run[2] != 5, run  # never the forbidden token at position 2


def test_ngram_with_grammars_greedy_parity_and_drafts_accepted():
    """Greedy outputs under a JSON schema, a regex and a choice are token for token those of
    decoding without drafts, drafts are accepted on the copy-heavy prompt, and every output
    matches its constraint; batched and one by one, with asynchronous scheduling."""
    import json
    import re

    import jsonschema

    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.sampling_params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 120}},
              "required": ["text"], "additionalProperties": False}
    regex = r"(The (quick|lazy) [a-z]+ ?){1,6}\."
    prompts = [f"Repeat the text as JSON {{\"text\": ...}}.\nText: {COPY_TEXT}\nJSON: {{\"text\": \"{COPY_TEXT[:30]}",
               f"Copy: {COPY_TEXT}\nCopy: The quick",
               "Is the sky blue? Answer yes or no:"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(regex=regex)),
              SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=SO(choice=["yes", "no"]))]
    base = LLM(num_kv_blocks=64, max_num_batched_tokens=128)
    want = [base.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    spec = _spec_llm(async_scheduling=True)
    got = [spec.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec.engine.core.spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    batched = [o.outputs[0] for o in spec.generate(prompts, params)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in want]
    for o, sp in zip(batched, params):
        if o.finish_reason != "stop":
            continue
        if sp.structured_outputs.json is not None:
            jsonschema.validate(json.loads(o.text), schema)
        elif sp.structured_outputs.regex is not None:
            assert re.fullmatch(regex, o.text), o.text
        else:
            assert o.text in ("yes", "no")
    assert spec.engine.scheduler.kv_cache_manager.num_used_blocks == 0
