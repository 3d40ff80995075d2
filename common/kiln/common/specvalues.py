"""The value readers of an engine spec: numbers and Kubernetes quantities, canonical decimal
text, bounded integers, paths on a claim, and canonical JSON (what the engine hash is taken
over).  Torch-free and dependency-free, as ``kiln.common.enginespec`` which re-exports them."""

from __future__ import annotations

import json
import os
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping

__all__ = ["EngineSpecError", "parse_quantity", "canonical_json"]

_QUANTITY_RE = re.compile(r"^([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_SUFFIX = {
    None: Decimal(1), "m": Decimal("0.001"), "k": Decimal(10**3), "M": Decimal(10**6),
    "G": Decimal(10**9), "T": Decimal(10**12), "Ki": Decimal(2**10), "Mi": Decimal(2**20),
    "Gi": Decimal(2**30), "Ti": Decimal(2**40),
}



class EngineSpecError(ValueError):
    """A build spec that cannot be normalized: unknown method, bad group size, no model
    source or more than one, a malformed quantity.  The message names the field."""


def _claim_path(path: Any, field_name: str) -> str:
    """A path on a claim, normalized (``a/./b`` = ``a/b``, no leading ``/``; ``.`` for the
    claim's root).  Raises ``EngineSpecError`` for a path that leaves the claim (``..``)."""
    p = os.path.normpath(str(path or ".")).lstrip("/") or "."
    if p == ".." or p.startswith("../"):
        raise EngineSpecError(f"{field_name}: {path!r} leaves the claim; give a path inside it")
    return p


def parse_quantity(value: Any, field_name: str = "value") -> Decimal:
    """Parse a number or a Kubernetes-style quantity (``0.5``, ``"0.5"``, ``"500m"``, ``"1Ki"``).

    Returns a ``Decimal``.  Raises ``EngineSpecError`` for booleans, malformed strings and
    non-finite values.
    """
    if isinstance(value, bool):
        raise EngineSpecError(f"{field_name}: expected a number or quantity, got a boolean")
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        d = Decimal(repr(value))
    elif isinstance(value, (str, Decimal)):
        if isinstance(value, Decimal):
            d = value
        else:
            m = _QUANTITY_RE.match(value.strip())
            if not m:
                raise EngineSpecError(f"{field_name}: {value!r} is not a number or quantity")
            try:
                d = Decimal(m.group(1)) * _SUFFIX[m.group(2)]
            except InvalidOperation as e:  # pragma: no cover - regex already filters
                raise EngineSpecError(f"{field_name}: {value!r} is not a number") from e
    else:
        raise EngineSpecError(f"{field_name}: expected a number or quantity, got {type(value).__name__}")
    if not d.is_finite():
        raise EngineSpecError(f"{field_name}: {value!r} is not finite")
    return d


def _decimal_str(d: Decimal) -> str:
    """Canonical text of a decimal: no exponent, no trailing zeros (``0.50`` -> ``"0.5"``)."""
    s = format(d.normalize(), "f")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def _int(value: Any, field_name: str, minimum: int = 1, maximum: int | None = None) -> int:
    d = parse_quantity(value, field_name)
    if d != d.to_integral_value():
        raise EngineSpecError(f"{field_name}: {value!r} is not an integer")
    i = int(d)
    if i < minimum:
        raise EngineSpecError(f"{field_name}: {i} is below the minimum {minimum}")
    if maximum is not None and i > maximum:
        raise EngineSpecError(f"{field_name}: {i} is above the maximum {maximum}")
    return i




def canonical_json(obj: Any) -> str:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 kept.  Floats are refused (decimals
    are carried as canonical strings) so the text never depends on float printing."""

    def check(o: Any) -> None:
        if isinstance(o, float):
            raise EngineSpecError("canonical_json: floats are not allowed; use decimal strings")
        if isinstance(o, Mapping):
            for v in o.values():
                check(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                check(v)

    check(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
