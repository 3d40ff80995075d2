"""Asynchronous scheduling: the scheduler's placeholder bookkeeping, and the engine giving
exactly the synchronous engine's outputs (same tokens, texts, finish reasons) on a mixed
workload with stop conditions, seeded sampling, n > 1, penalties and aborts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.runtime.core.config import SchedulerConfig
from kiln.runtime.core.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus
from kiln.runtime.core.scheduler import Scheduler


def make(**kw) -> Scheduler:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 128)
    return Scheduler(SchedulerConfig(async_scheduling=True, **kw))


def test_schedule_appends_placeholder_and_plans_next_step_before_update():
    s = make(max_num_batched_tokens=64)
    r = Request("a", list(range(10)), max_tokens=3)
    s.add_request(r)
    out1 = s.schedule()  # prefill, samples token 10
    assert [(sr.num_computed_tokens, sr.num_new_tokens) for sr in out1.scheduled] == [(0, 10)]
    assert r.num_computed_tokens == 10 and r.output_token_ids == [PLACEHOLDER_TOKEN_ID]
    out2 = s.schedule()  # planned while step 1 "runs": decodes the placeholder at position 10
    assert [(sr.num_computed_tokens, sr.num_new_tokens) for sr in out2.scheduled] == [(10, 1)]
    assert r.output_token_ids == [PLACEHOLDER_TOKEN_ID] * 2 and r.num_real_output_tokens == 0
    s.update_from_output(out1, {"a": 42})
    assert r.output_token_ids == [42, PLACEHOLDER_TOKEN_ID] and r.num_real_output_tokens == 1
    out3 = s.schedule()
    assert [(sr.num_computed_tokens, sr.num_new_tokens) for sr in out3.scheduled] == [(11, 1)]
    s.update_from_output(out2, {"a": 43})
    # max_tokens (3) reached counting the placeholder: nothing more is scheduled for it
    assert s.schedule().scheduled == []
    s.update_from_output(out3, {"a": 44})
    assert r.output_token_ids == [42, 43, 44] and r.num_output_placeholders == 0
    s.finish_request("a", RequestStatus.FINISHED_LENGTH)
    assert s.kv_cache_manager.num_free_blocks == 64


def test_finish_drops_unresolved_placeholders_and_frees_blocks():
    s = make()
    r = Request("a", list(range(6)), max_tokens=10)
    s.add_request(r)
    out1 = s.schedule()
    s.schedule()  # step 2 in flight
    s.update_from_output(out1, {"a": 5})  # say 5 is EOS: the engine finishes the request
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert r.output_token_ids == [5] and r.num_output_placeholders == 0
    assert s.kv_cache_manager.num_free_blocks == 64 and not s.has_unfinished_requests()


def test_preempted_request_keeps_filled_token_and_resumes():
    s = make(num_kv_blocks=5, block_size=4, max_num_batched_tokens=64)
    a = Request("a", list(range(8)), max_tokens=8)
    b = Request("b", list(range(100, 108)), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    pending = s.schedule()  # both prefill: 4 blocks used
    for tok in range(20):
        out = s.schedule()
        s.update_from_output(pending, {sr.request_id: 1000 + tok for sr in pending.scheduled if sr.needs_sample})
        pending = out
        for r in (a, b):
            assert PLACEHOLDER_TOKEN_ID not in r.output_token_ids[: r.num_real_output_tokens]
        if s.num_preemptions_total:
            break
    assert s.num_preemptions_total >= 1
    s.update_from_output(pending, {sr.request_id: 7 for sr in pending.scheduled if sr.needs_sample})
    assert all(r.num_output_placeholders == 0 for r in (a, b))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    (Path(d) / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "eos_token_id": 3}))
    return str(d)


def _run(model: str, async_scheduling: bool):
    from kiln.runtime import SamplingParams
    from kiln.runtime.config import EngineArgs
    from kiln.runtime.engine import LLMEngine

    eng = LLMEngine(EngineArgs(model=model, load_format="dummy", seed=3, num_kv_blocks=24, block_size=8,
                               max_num_seqs=6, max_num_batched_tokens=24, async_scheduling=async_scheduling))
    eng.stream_outputs = False
    reqs = [
        ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30)),  # may stop on EOS (3)
        (list(range(10, 40)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        ([8, 9], SamplingParams(temperature=0.9, seed=11, n=3, max_tokens=15, ignore_eos=True)),
        ([20] * 17, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[50, 51, 52, 53, 54])),
        ([30, 31], SamplingParams(temperature=0.0, max_tokens=18, repetition_penalty=1.3, frequency_penalty=0.5)),
        (list(range(40, 90)), SamplingParams(temperature=0.0, max_tokens=1)),
        ([1, 2], SamplingParams(temperature=0.7, seed=5, max_tokens=25, logprobs=2)),
        (list(range(60, 75)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),  # aborted
    ]
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(f"r{i}", p, sp)
    done = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = [(c.token_ids, c.finish_reason, c.stop_reason,
                                   [round(lp.logprob, 4) for lp in (c.logprobs or [])]) for c in o.outputs]
        steps += 1
        if steps == 6:
            eng.abort_request("r7")
    assert eng.scheduler.kv_cache_usage == 0 and eng.scheduler.kv_cache_manager.num_free_blocks == 24
    return done


def test_async_engine_matches_sync_engine(tiny_model):
    sync = _run(tiny_model, False)
    asyn = _run(tiny_model, True)
    assert set(sync) == set(asyn) == {f"r{i}" for i in range(7)}
    for rid in sync:
        assert asyn[rid] == sync[rid], rid
        for toks, reason, _, _ in asyn[rid]:
            assert PLACEHOLDER_TOKEN_ID not in toks
            if reason == "length":
                assert len(toks) >= 1
    assert [len(t) for t, *_ in asyn["r2"]] == [15, 15, 15]
    assert len(asyn["r5"][0][0]) == 1


@pytest.mark.parametrize("setting, expect_async", [(None, False), (True, True), (False, False)])
def test_async_scheduling_is_off_on_the_cpu_by_default(tiny_model, setting, expect_async):
    """Default (None): asynchronous scheduling only on CUDA.  On the CPU the forward runs inside
    the launch, so an asynchronous engine would hand each token out one step late: with the
    default, the step that runs the prefill returns the first token (streaming TTFT = one step)."""
    from kiln.runtime import SamplingParams
    from kiln.runtime.config import EngineArgs
    from kiln.runtime.engine import LLMEngine

    eng = LLMEngine(EngineArgs(model=tiny_model, load_format="dummy", num_kv_blocks=24, block_size=8,
                               async_scheduling=setting))
    assert eng.async_scheduling is expect_async and eng.scheduler.config.async_scheduling is expect_async
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    first = eng.step()
    if expect_async:
        assert first == []  # read back one step later
    else:
        assert [len(o.outputs[0].token_ids) for o in first] == [1]
    while eng.has_unfinished_requests():
        eng.step()
