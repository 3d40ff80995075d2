"""Scheduler: token budget, chunked prefill, admission, preemption, both policies."""

from __future__ import annotations

import pytest

from kiln.runtime.core.config import SchedulerConfig
from kiln.runtime.core.request import Request, RequestStatus
from kiln.runtime.core.sched_output import SchedulerOutput
from kiln.runtime.core.scheduler import Scheduler


def make(**kw) -> Scheduler:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 128)
    return Scheduler(SchedulerConfig(**kw))


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {sr.request_id: token for sr in out.scheduled if sr.needs_sample})
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(sr.request_id, sr.num_computed_tokens, sr.num_new_tokens) for sr in out.scheduled]


# ---- config -------------------------------------------------------------------------
def test_config_requires_num_kv_blocks():
    with pytest.raises(TypeError):
        SchedulerConfig()  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_batched_tokens": -5}, "max_num_batched_tokens must be >= 1, got -5"),
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be >= 1, got 0"),
        ({"max_model_len": 1.5}, "max_model_len must be an int, got 1.5"),
        ({"policy": "fifo"}, "policy must be one of .* got 'fifo'"),
    ],
)
def test_config_validation(kw, msg):
    kw.setdefault("num_kv_blocks", 8)
    with pytest.raises(ValueError, match=msg):
        SchedulerConfig(**kw)


# ---- add_request --------------------------------------------------------------------
def test_add_request_rejects_too_long():
    s = make(max_model_len=20)
    with pytest.raises(ValueError, match=r"prompt \(15 tokens\) \+ max_tokens \(6\) = 21 tokens exceeds max_model_len 20"):
        s.add_request(Request("a", list(range(15)), max_tokens=6))
    assert not s.has_unfinished_requests()


def test_add_request_rejects_what_never_fits_the_pool():
    s = make(num_kv_blocks=4, max_model_len=1000)  # 16 tokens of KV
    with pytest.raises(ValueError, match="needs 5 KV blocks of 4 tokens .* pool has 4 blocks"):
        s.add_request(Request("a", list(range(15)), max_tokens=3))  # 17 KV tokens
    s.add_request(Request("b", list(range(15)), max_tokens=2))  # 16 KV tokens: fits exactly


def test_add_request_rejects_duplicate_id():
    s = make()
    s.add_request(Request("a", [1, 2], max_tokens=2))
    with pytest.raises(ValueError, match="already queued"):
        s.add_request(Request("a", [1, 2], max_tokens=2))


def test_add_request_rejects_empty_prompt():
    s = make()
    r = Request("a", [1], max_tokens=2)
    r.prompt_token_ids = []
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(r)


# ---- scheduling ---------------------------------------------------------------------
def test_prefill_then_decode():
    s = make()
    r = Request("a", list(range(10)), max_tokens=3)
    s.add_request(r)
    out = run_step(s, token=100)
    assert plan(out) == [("a", 0, 10)]
    assert out.scheduled[0].needs_sample
    assert out.num_prefill_tokens == 10 and out.num_decode_tokens == 0
    assert out.new_request_ids == ["a"]
    assert r.output_token_ids == [100] and r.num_computed_tokens == 10
    assert r.status == RequestStatus.RUNNING and r.first_scheduled_time is not None
    out = run_step(s, token=101)
    assert plan(out) == [("a", 10, 1)]
    assert out.num_decode_tokens == 1
    assert r.output_token_ids == [100, 101]
    assert s.num_running == 1 and s.num_waiting == 0


def test_chunked_prefill_mixed_with_decode():
    s = make(max_num_batched_tokens=8)
    a = Request("a", list(range(3)), max_tokens=10)
    s.add_request(a)
    run_step(s)  # a prefilled, decoding now
    b = Request("b", list(range(100, 120)), max_tokens=2)
    s.add_request(b)
    out = run_step(s)
    assert plan(out) == [("a", 3, 1), ("b", 0, 7)]
    assert not out.scheduled[1].needs_sample
    assert b.output_token_ids == []
    out = run_step(s)
    assert plan(out) == [("a", 4, 1), ("b", 7, 7)]
    out = run_step(s)
    assert plan(out) == [("a", 5, 1), ("b", 14, 6)]
    assert out.scheduled[1].needs_sample and b.num_output_tokens == 1
    assert out.num_batched_tokens == 7 <= 8


def test_budget_and_max_num_seqs():
    s = make(max_num_batched_tokens=10, max_num_seqs=2)
    for k in range(4):
        s.add_request(Request(f"r{k}", list(range(4)), max_tokens=5))
    out = run_step(s)
    assert plan(out) == [("r0", 0, 4), ("r1", 0, 4)]  # seq limit, not token limit
    assert s.num_waiting == 2
    s.finish_request("r0", RequestStatus.FINISHED_STOPPED)
    out = run_step(s)
    assert plan(out) == [("r1", 4, 1), ("r2", 0, 4)]


def test_budget_limits_decodes_oldest_first():
    s = make(max_num_batched_tokens=2, max_num_seqs=8)
    for k in range(3):
        s.add_request(Request(f"r{k}", [k], max_tokens=5))
    out = run_step(s)
    assert plan(out) == [("r0", 0, 1), ("r1", 0, 1)]
    out = run_step(s)
    assert plan(out) == [("r0", 1, 1), ("r1", 1, 1)]  # r2 waits: budget, FCFS


def test_prefix_cache_used_on_admission():
    s = make()
    shared = list(range(12))
    a = Request("a", shared + [50], max_tokens=4)
    s.add_request(a)
    run_step(s)
    b = Request("b", shared + [60, 61], max_tokens=4)
    s.add_request(b)
    out = run_step(s)
    assert plan(out) == [("a", 13, 1), ("b", 12, 2)]
    assert out.scheduled[1].num_cached_tokens == 12
    assert b.num_cached_tokens == 12
    kv = s.kv_cache_manager
    assert kv.get_block_ids("a")[:3] == kv.get_block_ids("b")[:3]
    assert kv.prefix_cache_hits == 12


def test_decode_gets_new_block_when_last_full():
    s = make(block_size=4)
    r = Request("a", list(range(4)), max_tokens=6)
    s.add_request(r)
    out = run_step(s)
    assert len(out.scheduled[0].block_ids) == 1
    out = run_step(s)  # computes token 4 -> needs block 2
    assert len(out.scheduled[0].block_ids) == 2


def test_preempts_newest_and_resumes_first():
    # 6 blocks of 4 tokens; a, b each take 2 blocks for the prompt and grow.
    s = make(num_kv_blocks=6, block_size=4, max_model_len=24, max_num_seqs=2)
    a = Request("a", list(range(8)), max_tokens=12)
    b = Request("b", list(range(100, 108)), max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]
    d = Request("d", list(range(200, 204)), max_tokens=2)
    s.add_request(d)  # waits: max_num_seqs
    preempted = []
    for _ in range(10):
        out = run_step(s)
        preempted += out.preempted_request_ids
        if preempted:
            break
    assert preempted == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions_total == 1
    assert b.num_output_tokens > 0  # outputs kept
    assert list(s.waiting) == [b, d]  # the preempted request goes first
    assert s.kv_cache_manager.get_block_ids("b") == []
    assert "b" not in [sr.request_id for sr in out.scheduled]
    assert out.new_request_ids == []  # no admission in a step that preempted
    # Finish a: b is readmitted first, recomputing prompt + outputs in one chunk.
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    n_out = b.num_output_tokens
    out = run_step(s)
    assert out.new_request_ids == ["b", "d"]
    assert out.scheduled[0].num_new_tokens + out.scheduled[0].num_computed_tokens == 8 + n_out
    assert b.num_output_tokens == n_out + 1


def test_preempt_self_when_alone_cannot_happen_but_self_blocks():
    # Two requests that cannot both grow: the newer one preempts itself, the older runs.
    s = make(num_kv_blocks=3, block_size=4, max_model_len=12)
    a = Request("a", list(range(4)), max_tokens=8)
    b = Request("b", list(range(10, 14)), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    for _ in range(40):
        out = run_step(s)
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        for sr in out.scheduled:
            if sr.request.num_output_tokens >= sr.request.max_tokens:
                s.finish_request(sr.request_id, RequestStatus.FINISHED_LENGTH)
        s.kv_cache_manager.check_invariants()
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests()
    assert s.num_preemptions_total >= 1
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8


def test_guaranteed_no_evict_admits_only_what_fits():
    s = make(num_kv_blocks=6, block_size=4, max_model_len=24, policy="guaranteed_no_evict")
    a = Request("a", list(range(8)), max_tokens=9)  # 16 KV tokens -> 4 blocks reserved
    b = Request("b", list(range(100, 108)), max_tokens=9)
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert plan(out) == [("a", 0, 8)]  # b would need 4 more blocks, 2 are left
    assert s.num_waiting == 1
    for _ in range(8):
        out = run_step(s)
        assert not out.preempted_request_ids
    assert a.num_output_tokens == 9
    s.finish_request("a", RequestStatus.FINISHED_LENGTH)
    out = run_step(s)
    assert plan(out) == [("b", 0, 8)]
    assert s.num_preemptions_total == 0


def test_finish_request_from_waiting_running_and_idempotent():
    s = make(max_num_seqs=1)
    a = Request("a", [1, 2, 3], max_tokens=4)
    b = Request("b", [4, 5, 6], max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)  # from waiting
    assert b.status == RequestStatus.FINISHED_ABORTED and s.num_waiting == 0
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)  # from running
    assert a.status.finish_reason == "stop"
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)  # no-op
    s.finish_request("nope", RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert s.kv_cache_manager.num_allocated_uncached_blocks == 0
    assert not s.has_unfinished_requests()
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_request("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped():
    s = make()
    a = Request("a", [1, 2, 3], max_tokens=4)
    s.add_request(a)
    out = s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out, {"a": 9})
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert s.kv_cache_manager.num_allocated_uncached_blocks == 0


def test_missing_sample_raises():
    s = make()
    s.add_request(Request("a", [1, 2, 3], max_tokens=4))
    out = s.schedule()
    with pytest.raises(KeyError, match="no sampled token"):
        s.update_from_output(out, {})


def test_empty_schedule():
    s = make()
    out = s.schedule()
    assert out.is_empty and out.num_batched_tokens == 0
    assert not s.has_unfinished_requests()
    assert s.kv_cache_usage == 0.0


def test_check_request_queues_nothing():
    s = make(num_kv_blocks=4, max_model_len=1000)
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        s.check_request(Request("a", list(range(15)), max_tokens=3))
    s.check_request(Request("b", list(range(15)), max_tokens=2))
    assert not s.has_unfinished_requests()


def test_small_pool_warns(caplog):
    with caplog.at_level("WARNING"):
        make(num_kv_blocks=2, block_size=4, max_model_len=64)
    assert "KV pool holds 8 tokens" in caplog.text


def test_core_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import kiln.runtime.core.scheduler, kiln.runtime.core.kv_cache_manager, kiln.runtime.core.block_pool\n"
        "import kiln.runtime.core.sched_output, kiln.runtime.core.config\n"
        "assert 'torch' not in sys.modules, 'the scheduling core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
