"""Builtin LoRA adapters: seeded random PEFT adapters shaped for whatever base they are made
for, so benchmarks and demos have adapters without a model hub.  Torch-free: the operator
(``spec.adapters[].builtin``) and ``kiln adapter fetch --source builtin:...`` read them here;
the runtime writes the folder (``kiln.runtime.lora.builtin``).

As a source string (``kiln adapter fetch --source``), like ``builtin:NAME`` for models::

    builtin:random                                   # rank 16, alpha = rank, seed 0, all seven targets
    builtin:random?rank=8&seed=3&alpha=4&targets=q_proj,v_proj

In an InferenceEngine: ``builtin: {name: random, rank: 8, seed: 3, alpha: 4, targets: [q_proj, v_proj]}``.
Both spell the same :class:`BuiltinAdapter`; ``to_cli`` writes its canonical string (every
parameter, targets in ``TARGETS`` order), so equivalent spellings name the same adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .specvalues import EngineSpecError

__all__ = ["BUILTIN_ADAPTERS", "TARGETS", "MAX_RANK", "BuiltinAdapter"]

#: The builtin adapters: ``random`` (A ~ N(0, 1/in), B ~ N(0, 1/rank), seeded; see
#: ``kiln.runtime.lora.builtin``).
BUILTIN_ADAPTERS = ("random",)
#: Target modules, in canonical order (those Kiln serves).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_RANK = 64  # the largest rank Kiln serves (--max-lora-rank)
MAX_SEED = 2**63 - 1
_PARAMS = ("rank", "alpha", "seed", "targets")


def _int(v: Any, what: str, low: int, high: int) -> int:
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            raise EngineSpecError(f"{what}: expected an integer in {low}..{high}, got {v!r}") from None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise EngineSpecError(f"{what}: expected an integer in {low}..{high}, got {v!r}")
    return v


def _alpha(v: Any, what: str) -> float:
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise EngineSpecError(f"{what}: expected a positive number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise EngineSpecError(f"{what}: expected a positive number, got {v!r}")
    return float(v)


def _targets(v: Any, what: str) -> tuple[str, ...]:
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not items:
        raise EngineSpecError(f"{what}: expected a non-empty list of {', '.join(TARGETS)}, got {v!r}")
    names = [str(x).strip() for x in items]
    bad = [n for n in names if n not in TARGETS]
    if bad:
        raise EngineSpecError(f"{what}: {bad[0]!r} is not a target module (one of {', '.join(TARGETS)})")
    if len(set(names)) != len(names):
        raise EngineSpecError(f"{what}: a target module is given twice in {v!r}")
    return tuple(t for t in TARGETS if t in names)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass(frozen=True)
class BuiltinAdapter:
    """A builtin adapter, normalized.

    Fields:
        name: one of ``BUILTIN_ADAPTERS``.
        rank: ``r``, 1..64.
        alpha: ``lora_alpha`` (the delta is scaled by ``alpha / rank``).
        seed: the weights' random seed (the same parameters and base give the same bytes).
        targets: target modules, in ``TARGETS`` order.
    """

    name: str = "random"
    rank: int = 16
    alpha: float = 16.0
    seed: int = 0
    targets: tuple[str, ...] = TARGETS

    @classmethod
    def from_params(cls, name: Any, params: Mapping[str, Any], path: str) -> "BuiltinAdapter":
        """Build from a name and raw parameters (``rank``, ``alpha``, ``seed``, ``targets``);
        ``path`` prefixes error messages.  Raises ``EngineSpecError``."""
        name = str(name or "").strip().lower()
        if name not in BUILTIN_ADAPTERS:
            raise EngineSpecError(f"{path}: unknown builtin adapter {name!r} (available: "
                                  f"{', '.join(BUILTIN_ADAPTERS)})")
        unknown = sorted(set(params) - set(_PARAMS))
        if unknown:
            raise EngineSpecError(f"{path}: unknown parameter {unknown[0]!r} (parameters: {', '.join(_PARAMS)})")
        rank = _int(params["rank"], f"{path}.rank", 1, MAX_RANK) if params.get("rank") is not None else 16
        alpha = _alpha(params["alpha"], f"{path}.alpha") if params.get("alpha") is not None else float(rank)
        seed = _int(params["seed"], f"{path}.seed", 0, MAX_SEED) if params.get("seed") is not None else 0
        targets = _targets(params["targets"], f"{path}.targets") if params.get("targets") is not None else TARGETS
        return cls(name=name, rank=rank, alpha=alpha, seed=seed, targets=targets)

    @classmethod
    def from_string(cls, src: str) -> "BuiltinAdapter":
        """Parse ``builtin:NAME[?rank=R&alpha=A&seed=S&targets=T1,T2]``.  Raises
        ``EngineSpecError``."""
        src = src.strip()
        if not src.startswith("builtin:"):
            raise EngineSpecError(f"builtin adapter: {src!r} does not start with builtin:")
        name, _, query = src[len("builtin:"):].partition("?")
        params: dict[str, str] = {}
        for part in query.split("&") if query else ():
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or not key or not value.strip():
                raise EngineSpecError(f"builtin adapter {src!r}: {part!r} is not KEY=VALUE")
            if key in params:
                raise EngineSpecError(f"builtin adapter {src!r}: {key} is given twice")
            params[key] = value
        return cls.from_params(name, params, f"builtin adapter {src!r}")

    @classmethod
    def from_dict(cls, raw: Any, path: str) -> "BuiltinAdapter":
        """Parse an InferenceEngine ``adapters[].builtin`` object (``name`` and the
        parameters).  Raises ``EngineSpecError``."""
        if not isinstance(raw, Mapping):
            raise EngineSpecError(f"{path}: expected an object {{name, rank, alpha, seed, targets}}")
        params = {k: v for k, v in raw.items() if k != "name"}
        return cls.from_params(raw.get("name"), params, path)

    def to_cli(self) -> str:
        """The canonical source string (parsed back by ``from_string`` to this adapter)."""
        return (f"builtin:{self.name}?rank={self.rank}&alpha={_number(self.alpha)}&seed={self.seed}"
                f"&targets={','.join(self.targets)}")

    def to_dict(self) -> dict[str, Any]:
        """The canonical object (the CRD's field names)."""
        return {"name": self.name, "rank": self.rank, "alpha": self.alpha, "seed": self.seed,
                "targets": list(self.targets)}
