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
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidRequestError
from ..processing.input import check_structured_outputs
from ..sampling_params import StructuredOutputsParams
from ..outputs import RequestOutput
from ..structured_output.tool_parsers import ToolCall, ToolParser, get_parser, repeat_cut
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

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """A finished output as (content or None, calls); ``cut``: it ended at max_tokens,
        so an unfinished last call is dropped, not returned as content."""
        p = self.parser.parse(text, final=True, cut=cut)
        if not p.calls:
            return p.content, []
        return p.content.strip() or None, p.calls


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
    try:
        constrained = req.structured() is not None
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if constrained:  # one grammar decides each token: calls in the parser's format, or the constraint
        raise InvalidRequestError("tools cannot be combined with response_format, structured_outputs or guided_*: "
                                  "the output is either tool calls or the constrained text (give tool_choice "
                                  '"none" to keep the constraint)')
    try:
        parser = get_parser(parser_name)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    return ToolPlan(parser, fns, choice, named, req.parallel_tool_calls)


def prepare_conversation(conv: list[dict[str, Any]], plan: ToolPlan | None, template_has_tools: bool,
                         parser: ToolParser | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument for the chat template.

    A template that reads ``tools`` gets them as OpenAI's definitions.  For one that does
    not, the tools are described in the system turn in the plan's format, and earlier
    assistant calls are written into their turn's text in that format; without a plan (no
    tools shown: ``tool_choice`` "none") in ``parser``'s, the served format.
    """
    if template_has_tools:
        return conv, ([{"type": "function", "function": f} for f in plan.functions] if plan else None)
    parser = plan.parser if plan else parser
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


async def stop_repeated_calls(gen: AsyncIterator[RequestOutput], parser: ToolParser,
                              n: int) -> AsyncIterator[RequestOutput]:
    """``gen``'s outputs, each choice ended (finish_reason "stop", its text up to the calls
    before) once it repeats a call it made already (``tool_parsers.repeat_cut``): small models
    loop on a call until max_tokens.  The generation (``n`` choices) is aborted once every
    choice ended."""
    cut: dict[int, str] = {}
    ended: set[int] = set()
    try:
        async for out in gen:
            outs = []
            for c in out.outputs:
                if c.index in cut:  # already ended here: nothing new
                    c = replace(c, text=cut[c.index], delta_text="", delta_token_ids=[], delta_logprobs=[],
                                finish_reason="stop", stop_reason=None)
                elif c.finish_reason in (None, "stop", "length") and ("}" in c.delta_text or ">" in c.delta_text):
                    # (also on the last output: the repeat may end in the step that stops)
                    pos = repeat_cut(parser, c.text)
                    if pos is not None:
                        before = len(c.text) - len(c.delta_text)
                        cut[c.index] = c.text[:pos]
                        c = replace(c, text=c.text[:pos], delta_text=c.text[before:pos] if pos > before else "",
                                    finish_reason="stop", stop_reason=None)
                if c.finish_reason is not None:
                    ended.add(c.index)
                outs.append(c)
            done = bool(cut) and len(ended) == n
            yield replace(out, outputs=outs, finished=out.finished or done)
            if done or out.finished:
                return
    finally:
        await gen.aclose()  # an early end aborts the generation
