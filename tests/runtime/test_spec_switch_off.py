"""The speculation switch-off (``spec_decode.switch_off.SwitchOff``): decisions from measured
output tokens per second, driven by a clock the test advances (each step takes the time and
yields the tokens a workload of known speeds would); idle time steers nothing (a probe's cost
is its mode's mean step time, and the time after requests ended by a stop string is no
sample); a fixed switch-off size must be an integer."""

from __future__ import annotations

import time

import pytest

from kiln.runtime.spec_decode.config import SpeculativeConfig
from kiln.runtime.spec_decode.switch_off import (
    MIN_STEPS_BETWEEN_PROBES,
    PROBE_SHARE,
    PROBE_STEPS,
    SwitchOff,
    bucket_of,
    bucket_range,
)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drive(policy: SwitchOff, clock: Clock, batch: int, steps: int, speeds: dict[bool, tuple[float, int]]):
    """Run ``steps`` steps over ``batch`` sequences; a step in mode m takes ``speeds[m][0]``
    seconds and yields ``speeds[m][1]`` tokens.  Returns the modes chosen, in order."""
    modes = []
    for _ in range(steps):
        on = policy.decide(batch)
        policy.begin(on, batch)
        seconds, tokens = speeds[on]
        clock.now += seconds
        policy.add_tokens(tokens)
        modes.append(on)
    return modes


def time_share(modes, speeds, mode: bool) -> float:
    """Fraction of the wall time ``modes`` spent in ``mode``."""
    t = {m: modes.count(m) * speeds[m][0] for m in (True, False)}
    return t[mode] / (t[True] + t[False])


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    assert [bucket_range(i) for i in range(5)] == [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16)]
    for n in range(1, 200):
        low, high = bucket_range(bucket_of(n))
        assert low <= n <= high


def test_drafts_that_pay_stay_on_and_plain_decoding_is_probed_rarely():
    clock = Clock()
    p = SwitchOff(8, adaptive=True, clock=clock)
    # with drafts: 2.5 tokens per 12 ms; plain: 1 token per 10 ms
    modes = drive(p, clock, 1, 2000, {True: (0.012, 3), False: (0.010, 1)})
    assert modes[:PROBE_STEPS] == [True] * PROBE_STEPS  # a new bucket starts with drafts
    assert modes[PROBE_STEPS:2 * PROBE_STEPS] == [False] * PROBE_STEPS  # then measures plain decoding
    plain_time = modes.count(False) * 0.010
    assert plain_time <= 2 * PROBE_SHARE * (clock.now - 100.0) + PROBE_STEPS * 0.010
    assert modes[-MIN_STEPS_BETWEEN_PROBES:].count(True) >= MIN_STEPS_BETWEEN_PROBES - PROBE_STEPS
    r = p.rates()["1-1"]
    assert r["speculative"] == pytest.approx(3 / 0.012) and r["plain"] == pytest.approx(1 / 0.010)


def test_drafts_that_do_not_pay_are_switched_off_and_probed_within_the_share():
    clock = Clock()
    p = SwitchOff(8, adaptive=True, clock=clock)
    # a host-bound draft model: 3 tokens per 80 ms against 1 per 10 ms
    modes = drive(p, clock, 1, 3000, {True: (0.080, 3), False: (0.010, 1)})
    spec_time = modes.count(True) * 0.080
    # the first probe (4 steps) plus later probes each followed by 1/PROBE_SHARE times their time
    assert spec_time <= PROBE_STEPS * 0.080 + 1.5 * PROBE_SHARE * (clock.now - 100.0)
    assert modes.count(True) > PROBE_STEPS  # probed again: traffic may change
    assert not any(modes[2 * PROBE_STEPS:2 * PROBE_STEPS + MIN_STEPS_BETWEEN_PROBES])


def test_a_change_in_acceptance_turns_drafts_back_on():
    clock = Clock()
    p = SwitchOff(8, adaptive=True, clock=clock)
    drive(p, clock, 2, 500, {True: (0.020, 2), False: (0.010, 2)})  # free text: drafts rejected
    assert not p.decide(2) or p.buckets[bucket_of(2)].probing
    copy = {True: (0.020, 8), False: (0.010, 2)}
    modes = drive(p, clock, 2, 3000, copy)  # copy-heavy now
    assert time_share(modes[-1000:], copy, False) <= 1.5 * PROBE_SHARE


def test_each_batch_size_bucket_decides_on_its_own():
    clock = Clock()
    p = SwitchOff(16, adaptive=True, clock=clock)
    at_one, at_eight = {True: (0.012, 3), False: (0.010, 1)}, {True: (0.060, 20), False: (0.011, 8)}
    one = drive(p, clock, 1, 1000, at_one)
    eight = drive(p, clock, 8, 1000, at_eight)
    assert time_share(one[-500:], at_one, False) <= 1.5 * PROBE_SHARE
    assert time_share(eight[-500:], at_eight, True) <= 1.5 * PROBE_SHARE
    r = p.rates()
    assert r["1-1"]["speculative"] > r["1-1"]["plain"] and r["5-8"]["speculative"] < r["5-8"]["plain"]
    assert not p.decide(17)  # above max_batch_size: never


def test_a_fixed_size_always_drafts_up_to_it_and_still_measures():
    clock = Clock()
    p = SwitchOff(4, adaptive=False, clock=clock)
    modes = drive(p, clock, 3, 50, {True: (0.080, 3), False: (0.010, 1)})
    assert all(modes) and not p.decide(5) and not p.decide(0)
    assert p.rates()["3-4"]["speculative"] == pytest.approx(3 / 0.080)


def test_idle_time_is_not_metered():
    clock = Clock()
    p = SwitchOff(8, adaptive=False, clock=clock)
    p.begin(True, 1)
    clock.now += 0.01
    p.add_tokens(3)
    p.end()
    clock.now += 60.0  # no requests for a minute
    p.begin(True, 1)
    clock.now += 0.01
    p.add_tokens(3)
    p.end()
    assert p.rates()["1-1"]["speculative"] == pytest.approx(300.0)


def test_idle_time_inside_a_probe_does_not_postpone_the_next_probe():
    clock = Clock()
    p = SwitchOff(8, adaptive=True, clock=clock)
    free_text = {True: (0.040, 1), False: (0.010, 1)}  # drafts rejected: plain decoding wins
    drive(p, clock, 1, PROBE_STEPS + 1, free_text)  # the drafts' first probe, then the plain probe's first step
    assert p.buckets[0].probing is False
    p.end()
    clock.now += 600.0  # ten minutes without requests, in the middle of the probe
    assert not any(drive(p, clock, 1, PROBE_STEPS - 1, free_text))  # the probe's other steps
    # the traffic turns copy-heavy and drafts pay: within 3000 steps (30 s) drafts must be
    # probed again and win, as they are without the idle time (after 64 steps)
    copy = {True: (0.012, 5), False: (0.010, 1)}
    modes = drive(p, clock, 1, 3000, copy)
    assert time_share(modes[-1000:], copy, False) <= 1.5 * PROBE_SHARE


def test_idle_time_after_a_stop_string_is_not_credited_to_a_mode():
    from kiln.runtime import LLM, SamplingParams

    prompt = "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry,"
    llm = LLM(speculative_method="ngram", num_kv_blocks=64, max_num_batched_tokens=128)
    switch_off = llm.engine.core.spec.switch_off
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    # the greedy output is " apple, banana, apple, banana, ...": the stop string ends it mid-way
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=["banana, apple, banana"]))
    assert out[0].outputs[0].finish_reason == "stop"
    sums = {m: r.seconds for b in switch_off.buckets.values() for m, r in (("spec", b.spec), ("plain", b.plain))}
    time.sleep(2.0)  # no requests
    start = time.monotonic()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
    busy = time.monotonic() - start
    after = {m: r.seconds for b in switch_off.buckets.values() for m, r in (("spec", b.spec), ("plain", b.plain))}
    # the metered seconds grow at most by the time the last request took, never by the idle time
    assert sum(after.values()) <= sum(sums.values()) + busy, (sums, after, busy)


@pytest.mark.parametrize("size", [2.5, "4", "abc", True])
def test_a_fixed_size_that_is_not_an_integer_is_one_value_error(size):
    """``LLM(speculative_disable_by_batch_size=...)``: a float was accepted (and compared as a
    batch size), a string raised TypeError from ``<``."""
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size must be at least 1"):
        SpeculativeConfig("ngram", disable_by_batch_size=size)
