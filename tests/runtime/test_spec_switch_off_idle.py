"""Idle time must not steer the measured speculation switch-off (``spec_decode.switch_off``),
and a fixed switch-off size must be an integer.

- a probe's cost is its mode's mean step time, not the wall clock between its first and last
  step: idle time (or time at another batch size) in the middle of a probe must not postpone
  the next probe by ``1 / PROBE_SHARE`` times that time;
- a request that ends by a stop string (or a client abort) is dropped after the engine's step:
  the time until the next request must be credited to neither mode."""

from __future__ import annotations

import time

import pytest

from kiln.runtime.spec_decode.config import SpeculativeConfig
from kiln.runtime.spec_decode.switch_off import PROBE_SHARE, PROBE_STEPS, SwitchOff


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drive(policy: SwitchOff, clock: Clock, batch: int, steps: int, speeds: dict[bool, tuple[float, int]]):
    """``steps`` steps over ``batch`` sequences; one in mode m takes ``speeds[m][0]`` seconds and
    yields ``speeds[m][1]`` tokens (as in test_spec_switch_off.py).  Returns the modes chosen."""
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
    t = {m: modes.count(m) * speeds[m][0] for m in (True, False)}
    return t[mode] / (t[True] + t[False])


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
