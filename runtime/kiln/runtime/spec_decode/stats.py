"""Counters of speculative decoding (torch-free): drafts proposed and accepted, per draft
position, and verify steps, for ``/metrics`` and ``kiln bench``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative counts since the engine started.

    Fields:
        num_drafts: sequence-steps that verified at least one draft (verifications).
        num_draft_tokens: draft tokens proposed and verified (tokens).
        num_accepted_tokens: draft tokens the target accepted (tokens).
        accepted_per_position: ``[i]`` = verifications whose draft ``i`` (0-based) was
            accepted; acceptance at position ``i`` is that over ``proposed_per_position[i]``.
        proposed_per_position: ``[i]`` = verifications that had a draft at position ``i``.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_proposed`` drafts, the first ``num_accepted``
        of them accepted (tokens)."""
        if num_proposed <= 0:
            return
        grow = num_proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for i in range(num_proposed):
            self.proposed_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0..1; NaN before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields per sequence on average: accepted drafts + the
        target's own token (tokens; NaN before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    def acceptance_per_position(self) -> list[float]:
        """Acceptance rate at each draft position (0..1)."""
        return [a / p if p else float("nan") for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    def as_dict(self) -> dict:
        """The counts and rates as a plain dict (``kiln bench``'s JSON)."""
        return {"spec_num_drafts": self.num_drafts, "spec_draft_tokens": self.num_draft_tokens,
                "spec_accepted_tokens": self.num_accepted_tokens, "spec_acceptance_rate": self.acceptance_rate,
                "spec_mean_accepted_length": self.mean_accepted_length,
                "spec_acceptance_per_position": self.acceptance_per_position()}
