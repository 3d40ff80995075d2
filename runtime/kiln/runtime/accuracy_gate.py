"""The accuracy gate of ``kiln build`` (``--max-perplexity-increase``, ``--min-greedy-agreement``;
``build.accuracyGate`` in the CRD): the new engine is measured against its unquantized source
with ``kiln eval agreement`` (``kiln.runtime.eval.agreement``: perplexity of both on the shipped
held-out text, teacher-forced top-1 and greedy agreement over prompts cut from it) before it
is moved into place.  A failing engine is never moved into place (nothing is recorded, the
previous engine keeps serving); a passing one keeps its numbers in the manifest (``accuracy``)
and in the build's report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .build import BuildError

EXIT_GATE_FAILED = 3  # kiln build's exit code when the engine fails its accuracy gate


class AccuracyGateFailed(BuildError):
    """The engine failed its accuracy gate; ``accuracy`` holds the measured numbers."""

    def __init__(self, message: str, accuracy: dict):
        super().__init__(message)
        self.accuracy = accuracy


@dataclass(frozen=True)
class AccuracyGate:
    """Fields:
        max_perplexity_increase: largest allowed relative perplexity increase over the source
            (0.05: +5%), or None.
        min_greedy_agreement: smallest allowed share of greedy tokens equal to the source's, in
            [0, 1], or None.
        num_prompts / max_tokens: prompts of the greedy comparison, tokens of held-out text scored.
    """

    max_perplexity_increase: float | None = None
    min_greedy_agreement: float | None = None
    num_prompts: int = 8
    max_tokens: int = 2048

    @property
    def enabled(self) -> bool:
        return self.max_perplexity_increase is not None or self.min_greedy_agreement is not None


def measure(gate: AccuracyGate, source: str, engine: str | Path, device: str = "cpu") -> dict:
    """Measure ``engine`` against ``source`` and apply ``gate``.  Returns the numbers
    (``sourcePerplexity``, ``perplexity``, ``perplexityIncrease``, ``greedyAgreement``,
    ``teacherForcedTop1``, ``numPrompts``, ``numTokens``).

    Raises:
        AccuracyGateFailed: a bound is not met (the message names each, with its numbers).
    """
    from .eval import agreement  # noqa: PLC0415

    r = agreement(source, str(engine), None, gate.max_tokens, gate.num_prompts, device=device)
    src, ppl = float(r["perplexity_a"]), float(r["perplexity_b"])
    acc = {"sourcePerplexity": round(src, 4), "perplexity": round(ppl, 4),
           "perplexityIncrease": round(ppl / src - 1.0, 6), "greedyAgreement": round(float(r["greedy_token_agreement"]), 6),
           "teacherForcedTop1": round(float(r["teacher_forced_top1"]), 6), "numPrompts": int(r["num_prompts"]),
           "numTokens": int(r["num_tokens"])}
    fails = []
    if gate.max_perplexity_increase is not None and acc["perplexityIncrease"] > gate.max_perplexity_increase:
        fails.append(f"perplexity {src:.3f} -> {ppl:.3f} (+{acc['perplexityIncrease']:.2%}) is above the maximum "
                     f"increase of {gate.max_perplexity_increase:.2%}")
    if gate.min_greedy_agreement is not None and acc["greedyAgreement"] < gate.min_greedy_agreement:
        fails.append(f"greedy agreement {acc['greedyAgreement']:.3f} over {acc['numPrompts']} prompts is below the "
                     f"minimum of {gate.min_greedy_agreement:.3f}")
    if fails:
        raise AccuracyGateFailed("AccuracyGateFailed: the engine failed its accuracy gate: " + "; ".join(fails)
                                 + " (teacher-forced top-1 " + f"{acc['teacherForcedTop1']:.3f})", acc)
    return acc
