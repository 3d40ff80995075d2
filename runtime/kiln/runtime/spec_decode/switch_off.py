"""When speculation pays: output tokens per second with and without drafts, measured while
the engine runs, per batch-size bucket (torch-free).

A step with drafts costs more than a plain decode step (the proposer's work, ``k + 1`` query
tokens per sequence in the verify forward) and yields ``1 + accepted`` tokens per sequence.
Whether that is a gain depends on the method, both models, the device, the batch size (a
larger batch is compute-bound sooner, so verifying costs more) and on how well the current
traffic is predicted (copy-heavy text accepts n-gram drafts, free text does not).  A fixed
batch-size threshold (vLLM's ``speculative_disable_by_batch_size``) fits one of these
settings; here the engine compares the two rates it observes, the goodput criterion of
SmartSpec (Liu et al., "Optimizing Speculative Decoding for Serving Large Language Models
Using Goodput", 2024), measured instead of predicted.

Per bucket of running sequences (1, 2, 3-4, 5-8, ..., up to the configured maximum):

- Each mode keeps decayed sums of output tokens and wall seconds (factor ``DECAY`` per
  sample); its rate is their ratio, so long and short steps weigh by their time.
- A bucket starts with drafts (no measurement yet), then measures plain decoding for
  ``PROBE_STEPS`` steps, then runs the faster mode.
- The slower mode is probed again for ``PROBE_STEPS`` steps once ``1 / PROBE_SHARE`` times
  the probe's cost (its mode's mean step time) has passed and the faster mode has run at
  least ``MIN_STEPS_BETWEEN_PROBES`` steps: probes take at most about ``PROBE_SHARE`` of the
  time, and a change in the traffic's acceptance is seen within a few probes.
- Steps with a prefill chunk, and the time while no sequence runs, are no sample.

With an explicit ``speculative_disable_by_batch_size`` (``adaptive=False``) every step at or
below that size speculates, as in vLLM; the rates are still measured and reported.

Rejection sampling draws other random numbers than plain sampling, so a seeded sampled
request's tokens would depend on which steps drafted, that is on timing.  Where this rule says
no, such requests keep drafting alone (``SpecDecoder.active``): their tokens depend only on the
batch sizes they ran at, as with a fixed size.  Greedy tokens are the same in either mode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

#: Decay of the tokens/seconds sums per recorded step (older steps weigh less).
DECAY = 0.9
#: Consecutive steps of one mode per probe (the first plain step after a speculative one
#: only launches: asynchronous scheduling returns its tokens a step later).
PROBE_STEPS = 4
#: Most of the time spent probing the slower mode (fraction).
PROBE_SHARE = 1 / 32
#: Fewest steps of the faster mode between two probes of the slower one.
MIN_STEPS_BETWEEN_PROBES = 64


def bucket_of(num_running: int) -> int:
    """Bucket index of a batch of ``num_running`` sequences: 0 for 1, 1 for 2, 2 for 3-4,
    3 for 5-8, ... (``ceil(log2(n))``)."""
    return (max(num_running, 1) - 1).bit_length()


def bucket_range(index: int) -> tuple[int, int]:
    """The batch sizes ``(low, high)`` of bucket ``index`` (sequences)."""
    return (1, 1) if index == 0 else ((1 << (index - 1)) + 1, 1 << index)


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0
    samples: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds
        self.steps = self.steps * DECAY + 1
        self.samples += 1

    @property
    def step_seconds(self) -> float:
        """Mean seconds of a step in this mode (0 before any)."""
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def per_second(self) -> float | None:
        return self.tokens / self.seconds if self.samples and self.seconds > 0 else None


@dataclass
class _Bucket:
    spec: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    probing: bool | None = None  # the mode being probed (True: drafts), None: none
    probe_left: int = 0
    steps_since_probe: int = 0
    next_probe_at: float = 0.0  # clock seconds


class SwitchOff:
    """Decides per step whether to speculate, and meters the steps.

    Args:
        max_batch_size: running sequences above which no step speculates (the verify step's
            CUDA graphs and the draft model's KV pool are sized for it).
        adaptive: compare the measured rates below ``max_batch_size`` (else always draft).
        clock: seconds, monotonic (tests pass their own).

    The engine core calls ``before_step`` and ``decide`` at the start of every step,
    ``begin`` when the step's interval starts (after reading back a step in flight, whose
    tokens belong to the interval before), ``discard`` when the step turns out to be no
    sample, and ``add_tokens`` with the output tokens each processed step yields.
    """

    def __init__(self, max_batch_size: int, adaptive: bool, clock: Callable[[], float] = time.monotonic):
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self._open: tuple[bool, int, float] | None = None  # (speculative, bucket, start)
        self._open_tokens = 0
        self._last_processed: float | None = None  # when add_tokens last ran

    def decide(self, num_running: int) -> bool:
        """Whether a step over ``num_running`` sequences proposes drafts."""
        if not 0 < num_running <= self.max_batch_size:
            return False
        if not self.adaptive:
            return True
        b = self.buckets.setdefault(bucket_of(num_running), _Bucket())
        if b.probing is not None:
            if b.probe_left:
                return b.probing
            # the probe's last step has run; its cost is its mode's mean step time (idle time
            # or other batch sizes between its steps are no part of it)
            took = PROBE_STEPS * (b.spec if b.probing else b.plain).step_seconds
            b.probing, b.steps_since_probe = None, 0
            b.next_probe_at = self.clock() + took / PROBE_SHARE
        spec, plain = b.spec.per_second, b.plain.per_second
        if spec is None or plain is None:
            return self._start_probe(b, spec is None)
        faster = spec >= plain
        b.steps_since_probe += 1
        if b.steps_since_probe >= MIN_STEPS_BETWEEN_PROBES and self.clock() >= b.next_probe_at:
            return self._start_probe(b, not faster)
        return faster

    def _start_probe(self, b: _Bucket, speculative: bool) -> bool:
        b.probing, b.probe_left = speculative, PROBE_STEPS
        return speculative

    def begin(self, speculative: bool, num_running: int, now: float | None = None) -> None:
        """Close the open interval at ``now`` (crediting its mode and bucket) and open one
        for a step of ``num_running`` sequences."""
        now = self.clock() if now is None else now
        self._close(now)
        if 0 < num_running <= self.max_batch_size:
            index = bucket_of(num_running)
            self._open = (speculative, index, now)
            b = self.buckets.get(index)
            if b is not None and b.probing is speculative and b.probe_left:
                b.probe_left -= 1
        self._open_tokens = 0

    def discard(self) -> None:
        """The open interval's step is no sample of decoding speed (it computes a prefill
        chunk, or drafts for the seeded sequences only): it closes without crediting either
        mode (it still counts as a step of a probe)."""
        self._open = None

    def before_step(self, idle: bool) -> None:
        """At the start of a step; ``idle``: no sequence ran and no step was in flight, so
        the time since the last processed step (requests ended by a stop string or an abort,
        then none) is neither mode's."""
        if idle:
            self.end(self._last_processed)

    def add_tokens(self, n: int) -> None:
        """Output tokens of a processed step, credited to the open interval."""
        self._open_tokens += n
        self._last_processed = self.clock()

    def end(self, now: float | None = None) -> None:
        """The engine ran out of work: close the open interval at ``now`` and open none (the
        idle time until the next request is neither mode's)."""
        self.begin(False, 0, now)

    def _close(self, now: float) -> None:
        if self._open is None:
            return
        speculative, index, start = self._open
        self._open = None
        b = self.buckets.setdefault(index, _Bucket())
        (b.spec if speculative else b.plain).add(self._open_tokens, max(now - start, 0.0))

    def rates(self) -> dict[str, dict[str, float | None]]:
        """Measured output tokens per second per bucket: ``{"1-1": {"speculative": r,
        "plain": r}, "3-4": ...}`` (None where a mode has no measurement)."""
        out = {}
        for index in sorted(self.buckets):
            low, high = bucket_range(index)
            b = self.buckets[index]
            out[f"{low}-{high}"] = {"speculative": b.spec.per_second, "plain": b.plain.per_second}
        return out
