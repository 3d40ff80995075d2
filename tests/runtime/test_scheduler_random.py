"""Randomized invariant tests of the scheduler + KV cache manager.

A fake model drives the scheduler: the "KV" of token position ``p`` of a request is the
identity of its token prefix ``all_token_ids[:p+1]``, written into slot
``block_ids[p // block_size] * block_size + p % block_size`` when computed, and every step
re-reads the whole context through the block table, as attention does.  The sampled token
is a function of the prefix identity (a deterministic "greedy" model), so every request's
output must equal its reference run alone, whatever batching, chunking, prefix sharing
and preemption happened.

After each step: budgets held; ref counts equal the number of block tables holding each
block; no block both free and referenced; shared blocks only through equal hashes over
equal token prefixes; writes never go to a block another request holds.  At the end:
every request finished within a bounded number of steps and zero blocks held.
"""

from __future__ import annotations

import random

import pytest

from kiln.runtime.core.block_pool import ROOT_HASH, hash_block_tokens
from kiln.runtime.core.config import SchedulerConfig
from kiln.runtime.core.request import Request, RequestStatus
from kiln.runtime.core.scheduler import Scheduler

VOCAB = 50
STOP_TOKEN = 0


def next_token(prefix_id: int) -> int:
    """The fake model: the next token is a function of the whole prefix."""
    return (prefix_id * 2654435761 >> 7) % VOCAB


def extend_ids(ids: list[int], tokens: list[int]) -> None:
    """Prefix identities: ids[p] identifies tokens[:p+1]."""
    for p in range(len(ids), len(tokens)):
        ids.append(hash((ids[p - 1] if p else 17, tokens[p])))


def reference_output(prompt: list[int], max_tokens: int, use_stop: bool) -> list[int]:
    tokens, ids = list(prompt), []
    out = []
    while len(out) < max_tokens:
        extend_ids(ids, tokens)
        t = next_token(ids[-1])
        out.append(t)
        tokens.append(t)
        if use_stop and t == STOP_TOKEN:
            break
    return out


class Sim:
    """Drives a Scheduler with the fake model and checks invariants every step."""

    def __init__(self, cfg: SchedulerConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.s = Scheduler(cfg)
        self.rng = rng
        self.kv_slots: dict[int, int] = {}  # slot -> prefix identity written there
        self.prefix_ids: dict[str, list[int]] = {}
        self.use_stop: dict[str, bool] = {}
        self.finished: dict[str, Request] = {}
        self.aborted: dict[str, int] = {}  # aborted id -> its num_tokens at abort
        self.steps = 0

    def add(self, req: Request, use_stop: bool) -> None:
        self.s.add_request(req)
        self.prefix_ids[req.request_id] = []
        self.use_stop[req.request_id] = use_stop

    def abort_random(self) -> None:
        if self.s.requests:
            rid = self.rng.choice(sorted(self.s.requests))
            req = self.s.requests[rid]
            self.s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            self.finished[rid] = req
            self.aborted[rid] = req.num_tokens

    def slot(self, block_ids: list[int], p: int) -> int:
        bs = self.cfg.block_size
        return block_ids[p // bs] * bs + p % bs

    def step(self, abort_midway: bool = False) -> None:
        s, cfg, kv = self.s, self.cfg, self.s.kv_cache_manager
        out = s.schedule()
        self.steps += 1
        # Budgets.
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert out.num_batched_tokens == sum(sr.num_new_tokens for sr in out.scheduled)
        assert out.num_batched_tokens == out.num_prefill_tokens + out.num_decode_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert s.num_running <= cfg.max_num_seqs
        ids = [sr.request_id for sr in out.scheduled]
        assert len(ids) == len(set(ids))
        assert not set(ids) & set(out.preempted_request_ids)
        for rid in out.preempted_request_ids:
            assert kv.get_block_ids(rid) == []
            assert s.requests[rid].status == RequestStatus.PREEMPTED
        if cfg.policy == "guaranteed_no_evict":
            assert not out.preempted_request_ids
        self.check_kv()

        # The fake forward pass: write this step's KV, read the whole context.
        sampled = {}
        for sr in out.scheduled:
            req = sr.request
            assert sr.num_new_tokens >= 1
            assert sr.block_ids == kv.get_block_ids(req.request_id)
            end = sr.num_computed_tokens + sr.num_new_tokens
            assert end <= req.num_tokens
            assert len(sr.block_ids) == -(-end // cfg.block_size)  # exactly enough blocks
            pids = self.prefix_ids[req.request_id]
            extend_ids(pids, req.all_token_ids)
            for p in range(sr.num_computed_tokens, end):
                b = sr.block_ids[p // cfg.block_size]
                assert kv.pool.ref_cnt[b] == 1, f"{req.request_id} writes into block {b} shared by others"
                self.kv_slots[self.slot(sr.block_ids, p)] = pids[p]
            for p in range(end):
                got = self.kv_slots.get(self.slot(sr.block_ids, p))
                assert got == pids[p], f"{req.request_id} reads wrong KV at position {p}"
            if sr.needs_sample:
                sampled[req.request_id] = next_token(pids[end - 1])

        if abort_midway:  # a client goes away while the model runs
            self.abort_random()
        s.update_from_output(out, sampled)
        self.check_kv()

        # The engine's stop check.
        for sr in out.scheduled:
            req = sr.request
            if req.is_finished:
                continue
            if sr.needs_sample:
                last = req.output_token_ids[-1]
                if self.use_stop[req.request_id] and last == STOP_TOKEN:
                    s.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                elif req.num_output_tokens >= req.max_tokens:
                    s.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                if req.is_finished:
                    self.finished[req.request_id] = req
        self.check_kv()

    def check_kv(self) -> None:
        s, kv = self.s, self.s.kv_cache_manager
        kv.check_invariants()  # ref counts == tables holding a block; free XOR referenced
        bs = self.cfg.block_size
        # Every request holding blocks is running, and every running one holds enough.
        holders = {rid for rid in s.requests if kv.get_block_ids(rid)}
        assert holders <= {r.request_id for r in s.running}
        for r in s.running:
            assert len(kv.get_block_ids(r.request_id)) * bs >= r.num_computed_tokens
        for rid in self.finished:
            assert kv.get_block_ids(rid) == []
        # FCFS: preempted requests wait in front of never-scheduled ones, which keep
        # their arrival order; nothing waiting holds blocks.
        fresh = [r.first_scheduled_time is None for r in s.waiting]
        assert fresh == sorted(fresh), "a preempted request waits behind a new one"
        order = [int(r.request_id[1:]) for r in s.waiting if r.first_scheduled_time is None]
        assert order == sorted(order), "new requests out of arrival order"
        # Shared blocks: same position, equal token prefixes, equal chained hash.
        where: dict[int, list[tuple[str, int]]] = {}
        for r in s.running:
            for i, b in enumerate(kv.get_block_ids(r.request_id)):
                where.setdefault(b, []).append((r.request_id, i))
        for b, uses in where.items():
            if len(uses) < 2:
                continue
            assert kv.pool.block_hash[b] is not None, f"block {b} shared without a hash"
            positions = {i for _, i in uses}
            assert len(positions) == 1, f"block {b} at different positions {uses}"
            (i,) = positions
            prefixes = {tuple(s.requests[rid].all_token_ids[: (i + 1) * bs]) for rid, _ in uses}
            assert len(prefixes) == 1, f"block {b} shared by different token prefixes"
            h = ROOT_HASH
            tokens = next(iter(prefixes))
            for j in range(i + 1):
                h = hash_block_tokens(h, tokens[j * bs : (j + 1) * bs])
            assert kv.pool.block_hash[b] == h

    def finish_all(self, max_steps: int) -> None:
        start = self.steps
        while self.s.has_unfinished_requests():
            assert self.steps - start < max_steps, (
                f"not finished after {max_steps} steps: running {[r.request_id for r in self.s.running]}, "
                f"waiting {[r.request_id for r in self.s.waiting]}"
            )
            self.step()


def random_prompt(rng: random.Random, prefixes: list[list[int]], max_len: int) -> list[int]:
    n = rng.randint(1, max_len)
    if rng.random() < 0.6:
        base = list(rng.choice(prefixes))[: rng.randint(1, n)]
    else:
        base = []
    return (base + [rng.randrange(1, VOCAB) for _ in range(n)])[:n]


def run_random(seed: int, policy: str, caching: bool) -> Sim:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    max_model_len = rng.choice([32, 64, 96])
    min_blocks = -(-max_model_len // block_size)
    cfg = SchedulerConfig(
        max_num_seqs=rng.choice([1, 2, 4, 8, 32]),
        max_num_batched_tokens=rng.choice([1, 3, 8, 16, 64, 256]),
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=rng.randint(min_blocks, 2 * min_blocks),
        policy=policy,
        enable_prefix_caching=caching,
    )
    sim = Sim(cfg, rng)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(max_model_len)] for _ in range(3)]
    num_requests = 40
    total_tokens = 0
    for k in range(num_requests):
        prompt = random_prompt(rng, prefixes, max_model_len - 1)
        max_tokens = rng.randint(1, max_model_len - len(prompt))
        total_tokens += len(prompt) + max_tokens
        sim.add(Request(f"r{k}", prompt, max_tokens=max_tokens), use_stop=rng.random() < 0.5)
        for _ in range(rng.randint(0, 3)):
            sim.step(abort_midway=rng.random() < 0.05)
        if rng.random() < 0.05:
            sim.abort_random()
    # Bounded progress: the oldest running request always advances, so even with
    # recompute every request finishes within (tokens of all requests) * (requests) steps.
    sim.finish_all(max_steps=total_tokens * num_requests + 100)

    kv = sim.s.kv_cache_manager
    assert kv.num_allocated_uncached_blocks == 0
    assert kv.num_free_blocks == cfg.num_kv_blocks
    assert sim.s.num_running == 0 and sim.s.num_waiting == 0
    assert len(sim.finished) == num_requests
    assert kv.prefix_cache_hits <= kv.prefix_cache_queries
    for rid, req in sim.finished.items():
        assert req.is_finished
        if rid in sim.aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            assert req.num_tokens == sim.aborted[rid], f"{rid} changed after its abort"
            continue
        # Same outputs as the request alone: chunking, sharing, preemption change nothing.
        want = reference_output(req.prompt_token_ids, req.max_tokens, sim.use_stop[rid])
        assert req.output_token_ids == want, rid
    if policy == "guaranteed_no_evict":
        assert sim.s.num_preemptions_total == 0
    return sim


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload(seed, policy, caching):
    run_random(seed, policy, caching)


def test_random_workloads_exercise_preemption_and_sharing():
    """The random suite really covers preemption, chunking and prefix hits."""
    preemptions = hits = 0
    for seed in range(12):
        sim = run_random(seed, "max_utilization", True)
        preemptions += sim.s.num_preemptions_total
        hits += sim.s.kv_cache_manager.prefix_cache_hits
    assert preemptions > 0
    assert hits > 0


def test_tight_pool_many_requests_finish():
    """A pool that holds exactly one max-length request: every request still finishes."""
    rng = random.Random(1234)
    for policy in ("max_utilization", "guaranteed_no_evict"):
        cfg = SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=24, max_model_len=40, block_size=4,
            num_kv_blocks=10, policy=policy,
        )
        sim = Sim(cfg, rng)
        for k in range(30):
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
            sim.add(Request(f"t{k}", prompt, max_tokens=40 - len(prompt)), use_stop=False)
        sim.finish_all(max_steps=30 * 40 * 30)
        assert sim.s.kv_cache_manager.num_allocated_uncached_blocks == 0
        for req in sim.finished.values():
            assert req.num_output_tokens == req.max_tokens
