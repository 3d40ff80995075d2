"""Tool calling for chat requests: checks ``tools`` / ``tool_choice``, prepares the chat for
the template, forces calls with a grammar when asked, and turns the output into
``tool_calls`` (``structured_output.tool_parsers`` holds the formats).

``tool_choice``: ``none`` (the tools are not shown, the output is text), ``auto`` (the
default with tools: the output is parsed, calls become ``tool_calls``), ``required`` (at
least one call, forced by the format's grammar), ``{"type": "function", "function":
{"name": ...}}`` (exactly one call to that function, forced the same way).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..processing.input import check_structured_outputs
from ..sampling_params import StructuredOutputsParams
from ..structured_output.tool_parsers import ToolCall, ToolParser, get_parser
from .protocol import ChatCompletionRequest


@dataclass
class ToolPlan:
    """What a chat request does with its tools.

    Fields:
        parser: the served model's tool-call format.
        functions: ``{name, description?, parameters}`` of each tool.
        choice: "auto", "required" or "named".
        named: the forced function's name ("named").
        parallel: more than one call allowed (``parallel_tool_calls``).
    """

    parser: ToolParser
    functions: list[dict[str, Any]]
    choice: str
    named: str | None
    parallel: bool

    def grammar(self) -> StructuredOutputsParams | None:
        """The grammar that forces the calls (required / named), or None (auto)."""
        if self.choice == "auto":
            return None
        fns = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        tag = self.parser.structural_tag(fns, at_least_one=True,
                                         stop_after_first=self.choice == "named" or not self.parallel)
        return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished output as (content or None, calls)."""
        p = self.parser.parse(text, final=True)
        if not p.calls:
            return text, []
        content = p.content.strip()  # with an unfinished last call (max_tokens): its text
        return content or None, p.calls


# OpenAI's rule for function names; anything else could break the parsers' markup
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

def plan_tools(req: ChatCompletionRequest, parser_name: str) -> ToolPlan | None:
    """Check the request's tools; None when the output is plain text (no tools, or
    ``tool_choice: none``).

    Raises:
        InvalidRequestError: a malformed tool, a tool without ``parameters``, a parameters
            schema that does not compile (the grammar engine's message), a ``tool_choice``
            naming no tool, ``required`` without tools, or tools with another output constraint.
    """
    choice = req.tool_choice
    tools = req.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(named, str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}')
        choice = "named"
    elif choice not in ("auto", "required"):
        raise InvalidRequestError(f'tool_choice {choice!r} is not one of "none", "auto", "required" or a function')
    if not tools:
        raise InvalidRequestError(f"tool_choice {choice if choice != 'named' else named!r} needs tools")
    fns = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise InvalidRequestError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        if not _TOOL_NAME.fullmatch(f["name"]):
            raise InvalidRequestError(f"tools[{i}].function.name {f['name'][:80]!r} must be 1 to 64 letters, digits, "
                                      "'_' or '-' (as OpenAI's API)")
        if any(g["name"] == f["name"] for g in fns):
            raise InvalidRequestError(f"tools[{i}]: two tools are named {f['name']!r}")
        if not isinstance(f.get("parameters"), dict):
            raise InvalidRequestError(f"tools[{i}] ({f['name']}) has no parameters: give function.parameters, a JSON "
                                      'schema ({"type": "object", "properties": {}} for none)')
        try:
            check_structured_outputs(StructuredOutputsParams(json=f["parameters"]))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"tools[{i}] ({f['name']}) parameters: {e}") from None
        fns.append({k: f[k] for k in ("name", "description", "parameters") if k in f})
    if named is not None and named not in {f["name"] for f in fns}:
        raise InvalidRequestError(f"tool_choice names function {named!r}, which is not in tools")
    if choice != "auto" and req.structured() is not None:
        raise InvalidRequestError("tool_choice required / a named function cannot be combined with "
                                  "response_format or another output constraint")
    try:
        parser = get_parser(parser_name)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    return ToolPlan(parser, fns, choice, named, req.parallel_tool_calls)


def prepare_conversation(conv: list[dict[str, Any]], plan: ToolPlan | None,
                         template_has_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument for the chat template.

    A template that reads ``tools`` gets them as OpenAI's definitions.  For one that does
    not, the tools are described in the system turn in the parser's format, and earlier
    assistant calls are written into their turn's text in that format.
    """
    if template_has_tools:
        return conv, ([{"type": "function", "function": f} for f in plan.functions] if plan else None)
    parser = plan.parser if plan else None
    out = []
    for m in conv:
        if m.get("tool_calls") and parser is not None:
            text = (m.get("content") or "")
            m = {"role": m["role"], "content": (text + "\n" if text else "") + parser.render_calls(m["tool_calls"])}
        else:
            m = {"role": m["role"], "content": m.get("content") or ""}
        out.append(m)
    if plan is not None:
        prompt = plan.parser.system_prompt(plan.functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
