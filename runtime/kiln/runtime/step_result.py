"""A step's result: the sampled tokens by request id (:class:`StepResult`), and the launched
step they come from (:class:`PendingStep`), whose sampler may itself be launched late (a
step with a grammar samples once its bitmask is filled, ``ModelRunner.execute_async``)."""

from __future__ import annotations

import torch

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class StepResult:
    """Output of one step: sampled tokens (and logprobs) keyed by request id;
    ``forward_seconds`` is host time from launch until the result was read (seconds).

    A step that verified drafts (speculative decoding) maps each id to its verified run of
    tokens (a list) and its logprobs to a list of entries, one per token; ``num_accepted``
    then holds the drafts accepted per id (tokens).
    """

    sampled: dict[str, int | list[int]]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]] | list]
    forward_seconds: float
    num_accepted: dict[str, int] = field(default_factory=dict)


class PendingStep:
    """A launched step whose sampled ids are on their way to the host.

    ``result()`` waits for the device (a CUDA event recorded after the device -> pinned host
    copies) and returns the :class:`StepResult`; later calls return the same object.
    ``sample`` is a ``sampler.DeviceSample`` or a ``rejection_sampler.DeviceVerify``.

    A step whose sampler is not launched yet passes ``launch`` instead of ``sample`` and
    ``event``: a callable that launches it and returns ``(sample, event)``; ``launch()``
    calls it once (the model runner does before the next step's forward pass, ``result()``
    if nothing did).
    """

    def __init__(self, request_ids: list[str], sample, event, t0: float,
                 launch: Callable[[], tuple[object, object]] | None = None):
        self._ids = request_ids
        self._sample = sample
        self._event = event
        self._t0 = t0
        self._launch = launch
        self._result: StepResult | None = None

    @property
    def launched(self) -> bool:
        return self._launch is None

    def launch(self) -> None:
        """Launch the sampler if it is not launched yet (no wait for the device)."""
        if self._launch is not None:
            with torch.inference_mode():  # the logits are inference tensors; the mask is applied in place
                self._sample, self._event = self._launch()
            self._launch = None

    def result(self) -> StepResult:
        if self._result is None:
            self.launch()
            sampled: dict[str, int | list[int]] = {}
            lps: dict = {}
            accepted: dict[str, int] = {}
            if self._sample is not None:
                if self._event is not None:
                    self._event.synchronize()
                res = self._sample.materialize()
                for rid, tok, lp in zip(self._ids, res.token_ids, res.logprobs):
                    sampled[rid] = tok
                    if lp is not None:
                        lps[rid] = lp
                for rid, a in zip(self._ids, getattr(res, "num_accepted", ())):
                    if a is not None:
                        accepted[rid] = a
            self._result = StepResult(sampled, lps, time.perf_counter() - self._t0, accepted)
            self._sample = None
        return self._result
