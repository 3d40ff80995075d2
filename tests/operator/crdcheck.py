"""A small stand-in for the API server's CRD validation, for unit tests: defaulting, OpenAPI
validation (through jsonschema) and the CEL rules (through cel-python)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceengine.yaml"


def load_crd() -> dict:
    return yaml.safe_load(CRD_PATH.read_text())


def version_schema(crd: dict | None = None) -> dict:
    crd = crd or load_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def to_jsonschema(s: Any) -> Any:
    """OpenAPI v3 structural schema -> JSON Schema (draft 7)."""
    if isinstance(s, list):
        return [to_jsonschema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: to_jsonschema(v) for k, v in s.items() if not k.startswith("x-kubernetes-") and k != "default"}
    if s.get("x-kubernetes-int-or-string"):
        pattern = out.pop("pattern", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string", **({"pattern": pattern} if pattern else {})}]
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not s.get("x-kubernetes-preserve-unknown-fields") and "metadata" not in out["properties"]:
        out["additionalProperties"] = False  # the API server prunes unknown fields; tests want to see them
    return out


def apply_defaults(obj: Any, s: dict) -> Any:
    """The API server's defaulting: a missing property with a default gets it (recursively)."""
    if isinstance(obj, dict) and s.get("type") == "object":
        for name, sub in (s.get("properties") or {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(obj[name], sub)
    elif isinstance(obj, list) and "items" in s:
        return [apply_defaults(x, s["items"]) for x in obj]
    return obj


def cel_errors(obj: Any, s: dict, path: str = "") -> list[str]:
    """Messages of the CEL rules that ``obj`` breaks (skips the test without cel-python)."""
    import pytest

    celpy = pytest.importorskip("celpy")

    errors = []
    env = celpy.Environment()
    for rule in s.get("x-kubernetes-validations") or []:
        prog = env.program(env.compile(rule["rule"]))
        ok = prog.evaluate({"self": celpy.json_to_cel(obj)})
        if not bool(ok):
            errors.append(rule.get("message") or f"{path}: failed rule {rule['rule']}")
    if isinstance(obj, dict):
        for name, sub in (s.get("properties") or {}).items():
            if name in obj:
                errors += cel_errors(obj[name], sub, f"{path}.{name}")
    elif isinstance(obj, list) and "items" in s:
        for i, x in enumerate(obj):
            errors += cel_errors(x, s["items"], f"{path}[{i}]")
    return errors


def admit(obj: dict) -> tuple[dict, list[str]]:
    """Default and validate an InferenceEngine: ``(defaulted object, error messages)``."""
    import jsonschema

    s = version_schema()
    obj = apply_defaults(copy.deepcopy(obj), s)
    validator = jsonschema.Draft7Validator(to_jsonschema(s))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    if not errors:
        errors = cel_errors(obj, s)
    return obj, errors
