"""What a request asks its output to match, as one hashable :class:`GrammarSpec`, and the
check the API process runs on it before the request is admitted.

The spec is plain data (``kind``, ``text``): it crosses the ZeroMQ boundary inside the
request's :class:`~kiln.runtime.sampling_params.SamplingParams`, and the engine core compiles
it (``backend.GrammarCompilerCache``).  Validation builds xgrammar's ``Grammar`` from it
(the JSON schema, regex, EBNF or Lark converted to xgrammar's grammar, no token masks), so a
bad schema, regex or grammar is an HTTP 400 with xgrammar's own message before anything is
queued.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

#: The kinds of :class:`GrammarSpec` and what ``text`` holds for each.
KINDS = {
    "json": "a JSON schema (JSON text)",
    "json_object": "any JSON object (text unused)",
    "regex": "a regular expression the whole output matches",
    "ebnf": "an EBNF grammar (xgrammar's / GBNF dialect, rule 'root')",
    "lark": "a Lark grammar (rule 'start')",
    "structural_tag": "an xgrammar structural tag (JSON text)",
}

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint.

    Fields:
        kind: one of :data:`KINDS`.
        text: its source text (see :data:`KINDS`); schemas keep their key order, which is
            the order the output's properties follow.
    """

    kind: str
    text: str = ""


def choice_spec(choices: list[str]) -> GrammarSpec:
    """The spec of "exactly one of these strings" (vLLM's ``guided_choice``).

    Raises:
        ValueError: no choices, or a choice that is not a string.
    """
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"guided_choice must be a non-empty list of strings, got {choices!r}")
    fmt = {"type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def grammar_spec(grammar: str) -> GrammarSpec:
    """An EBNF grammar (it has ``::=`` rules) or else a Lark grammar (vLLM's
    ``guided_grammar`` takes both)."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("guided_grammar must be a non-empty string (EBNF or Lark)")
    return GrammarSpec("ebnf" if "::=" in grammar else "lark", grammar)


def json_spec(schema) -> GrammarSpec:
    """A JSON schema given as a dict (or a bool) or as JSON text.

    Raises:
        ValueError: text that is not JSON, or a value that is not a schema.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        return GrammarSpec("json_object") if schema else _refuse("the JSON schema `false` accepts nothing")
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return GrammarSpec("json", json.dumps(schema, ensure_ascii=False))


def _refuse(msg: str):
    raise ValueError(msg)


def clean_error(e: BaseException) -> str:
    """xgrammar's message without its C++ source location (one paragraph)."""
    msg = _CPP_PREFIX.sub("", str(e)).strip()
    return msg.split("\n\n")[0].strip()


def build_grammar(spec: GrammarSpec):
    """xgrammar's ``Grammar`` of a spec (no tokenizer needed).

    Raises:
        ValueError: the schema, regex or grammar is invalid (xgrammar's message).
    """
    import xgrammar as xgr  # noqa: PLC0415

    try:
        if spec.kind == "json":
            g = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True)
            _check_meta_schema(spec.text)
            return g
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
        if spec.kind == "lark":
            return xgr.Grammar.from_lark(spec.text)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.text)
    except _SchemaError as e:
        raise ValueError(f"invalid JSON schema: {e}") from None
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError / ValueError
        what = {"json": "invalid JSON schema", "regex": "invalid regex", "ebnf": "invalid EBNF grammar",
                "lark": "invalid Lark grammar", "structural_tag": "invalid structural tag"}.get(spec.kind, "invalid")
        raise ValueError(f"{what}: {clean_error(e)}") from None
    raise ValueError(f"unknown grammar kind {spec.kind!r} (one of {', '.join(KINDS)})")


class _SchemaError(ValueError):
    """A schema that xgrammar converts but that breaks JSON Schema's own rules."""


def _check_meta_schema(text: str) -> None:
    """Raises _SchemaError naming the first place where the schema breaks its draft's
    meta-schema (2020-12 unless ``$schema`` names another), e.g. ``{"anyOf": []}``, which
    xgrammar turns into a grammar that accepts nothing."""
    import jsonschema  # noqa: PLC0415

    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    err = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if err is not None:
        raise _SchemaError(f"at {err.json_path}: {err.message}")


def legacy_structural_tag(rf: dict) -> dict:
    """vLLM's / SGLang's older ``response_format`` structural tag, ``{"type": "structural_tag",
    "structures": [{"begin", "schema", "end"}], "triggers": [...]}``, as xgrammar's
    ``{"type": "structural_tag", "format": {"type": "triggered_tags", ...}}`` (free text until
    a trigger, then the tag whose ``begin`` it starts, its content matching ``schema``, up to
    ``end``); an ``rf`` with ``format`` is returned as it is.

    Raises:
        ValueError: neither ``format`` nor well-formed ``structures`` and ``triggers``.
    """
    if "format" in rf:
        return rf
    structures, triggers = rf.get("structures"), rf.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError('response_format structural_tag needs "format" (xgrammar\'s structural tag) or '
                         '"structures" and "triggers"')
    tags = []
    for i, st in enumerate(structures):
        if not (isinstance(st, dict) and isinstance(st.get("begin"), str) and isinstance(st.get("end"), str)
                and isinstance(st.get("schema"), (dict, bool))):
            raise ValueError(f'response_format structural_tag structures[{i}] needs "begin", "schema" and "end"')
        tags.append({"type": "tag", "begin": st["begin"],
                     "content": {"type": "json_schema", "json_schema": st["schema"]}, "end": st["end"]})
    if not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("response_format structural_tag triggers must be non-empty strings")
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def validate_spec(spec: GrammarSpec) -> None:
    """Raises ValueError (-> HTTP 400) with xgrammar's message when the spec cannot compile."""
    build_grammar(spec)
