"""Tool calls in three model formats: parse a completion into text and calls (whole or as it
streams), build the grammar that forces calls (``tool_choice`` required or a named function),
and describe the tools to a model whose chat template has no ``tools`` support.

Formats (``kiln serve --tool-call-parser``):

* ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, optionally after some text.
* ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole answer is
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), calls
  separated by ``; ``.
* ``mistral`` (Mistral's pre-v11 tokenizers): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
  after optional text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    """``content``: the text outside the calls that is settled (while streaming, text that
    could still turn into a call marker is held back); ``calls``: the calls complete so far;
    ``ok``: False when a final text had a call section that did not parse (then ``content``
    is the whole text and there are no calls) or an unfinished last call.  A final text
    that max_tokens ``cut`` drops its unfinished last call: that call's text is not content."""

    content: str
    calls: list[ToolCall]
    ok: bool = True


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_of(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _decode_objects(text: str, pos: int, sep: str, end: str | None) -> tuple[list, int, bool]:
    """JSON values from ``text[pos:]`` separated by ``sep`` (whitespace around allowed) up to
    ``end``; returns (values, position after the last, whether ``end`` / the text end was
    reached cleanly)."""
    out = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return out, pos, end is None
        if end is not None and text.startswith(end, pos):
            return out, pos + len(end), True
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out, pos, False
        out.append(obj)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(sep.strip(), pos):
            pos += len(sep.strip())


def _json_content(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": schema}


class ToolParser:
    """A tool-call format; subclasses set the spellings and ``parse``."""

    name = ""
    args_key = "arguments"

    def parse(self, text: str, final: bool, cut: bool = False) -> Parsed:
        raise NotImplementedError

    def tag(self, name: str, schema: dict) -> dict:
        """The structural-tag ``tag`` of one call to ``name`` (arguments matching ``schema``)."""
        raise NotImplementedError

    separator = "\n"

    def structural_tag(self, tools: list[dict], at_least_one: bool, stop_after_first: bool) -> dict:
        """xgrammar's structural tag forcing calls to these tools (``{"name", "parameters"}``
        each) in this format, and nothing else."""
        tags = [self.tag(t["name"], t["parameters"]) for t in tools]
        body = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                "at_least_one": at_least_one, "stop_after_first": stop_after_first}
        return {"type": "structural_tag", "format": self.wrap(body)}

    def wrap(self, body: dict) -> dict:
        return body

    def render_calls(self, calls: list[dict]) -> str:
        """Calls of an assistant turn (OpenAI ``tool_calls``) as this format's text."""
        raise NotImplementedError

    def example(self) -> str:
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        """The tools described for a chat template without ``tools`` support."""
        listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        return ("You can call functions. The available functions, as JSON schemas:\n" + listing +
                "\nTo call a function, answer with exactly:\n" + self.example() +
                "\nOtherwise answer normally.")


def _args_text(call: dict) -> str:
    f = call.get("function", call)
    args = f.get("arguments", "{}")
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesToolParser(ToolParser):
    name = "hermes"
    BEGIN, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str, final: bool, cut: bool = False) -> Parsed:
        i = text.find(self.BEGIN)
        if i < 0:  # a cut output drops the start of a call marker it ends in, as a stream holds it
            hold = _partial_suffix(text, self.BEGIN) if cut or not final else 0
            return Parsed(text[: len(text) - hold], [])
        calls = []
        last = i
        for m in self._BLOCK.finditer(text, i):
            c = self._decode(m.group(1))
            if c is None:
                return Parsed(text, [], False) if final else Parsed(text[:i], calls)
            calls.append(c)
            last = m.end()
        if final:
            tail = text[last:]
            rest = tail.strip()
            if rest.startswith(self.BEGIN):  # the last block lost its end tag (a stop or EOS)
                c = self._decode(rest[len(self.BEGIN):])
                if c is not None:
                    calls.append(c)
                    rest = tail = ""
                elif cut:  # the call max_tokens cut short
                    return Parsed(text[:i], calls, False)
            elif cut and rest and self.BEGIN.startswith(rest):  # cut inside the next call's start tag
                return Parsed(text[:i], calls, False)
            if not calls:
                return Parsed(text, [], False)
            if rest:  # text after the calls that is not a call: the calls stay, the rest is text
                return Parsed(text[:i] + tail, calls, False)
        return Parsed(text[:i], calls)

    def _decode(self, body: str) -> ToolCall | None:
        try:
            return _call_of(json.loads(body), self.args_key)
        except json.JSONDecodeError:
            return None

    def tag(self, name: str, schema: dict) -> dict:
        return {"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": _json_content(schema), "end": "}\n</tool_call>"}

    def render_calls(self, calls: list[dict]) -> str:
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.get("function", c)["name"])}, '
                         f'"arguments": {_args_text(c)}}}\n</tool_call>' for c in calls)

    def example(self) -> str:
        return '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>'


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    args_key = "parameters"
    separator = "; "
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool, cut: bool = False) -> Parsed:
        s = text.lstrip()
        if s.startswith(self.PYTHON_TAG):
            s = s[len(self.PYTHON_TAG):].lstrip()
        elif not final and (not s or self.PYTHON_TAG.startswith(s)):
            return Parsed("", [])
        if not s.startswith("{"):
            return Parsed(text, [])
        objs, pos, clean = _decode_objects(s, 0, ";", None)
        calls = [_call_of(o, self.args_key) for o in objs]
        if any(c is None for c in calls):
            return Parsed(text, [], False) if final else Parsed("", [])
        if final and not clean:  # an unfinished call: dropped when max_tokens cut it, else text
            return Parsed("" if cut else s[pos:], calls, False) if calls or cut else Parsed(text, [], False)
        if final and not calls:
            return Parsed(text, [], False)
        return Parsed("", calls)

    def tag(self, name: str, schema: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "parameters": ',
                "content": _json_content(schema), "end": "}"}

    def render_calls(self, calls: list[dict]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.get("function", c)["name"])}, "parameters": {_args_text(c)}}}'
                         for c in calls)

    def example(self) -> str:
        return '{"name": "<function name>", "parameters": {<arguments>}}'


class MistralToolParser(ToolParser):
    name = "mistral"
    BEGIN = "[TOOL_CALLS]"
    separator = ", "

    def parse(self, text: str, final: bool, cut: bool = False) -> Parsed:
        i = text.find(self.BEGIN)
        if i < 0:  # a cut output drops the start of a call marker it ends in, as a stream holds it
            hold = _partial_suffix(text, self.BEGIN) if cut or not final else 0
            return Parsed(text[: len(text) - hold], [])
        j = i + len(self.BEGIN)
        while j < len(text) and text[j].isspace():
            j += 1
        if j >= len(text) and cut:
            return Parsed(text[:i], [], False)
        if j >= len(text) or text[j] != "[":
            return Parsed(text, [], False) if final or j < len(text) else Parsed(text[:i], [])
        objs, pos, clean = _decode_objects(text, j + 1, ",", "]")
        calls = [_call_of(o, self.args_key) for o in objs]
        if any(c is None for c in calls):
            return Parsed(text, [], False) if final else Parsed(text[:i], [])
        if final and not clean and (cut or text[pos:].strip()):  # an unfinished call: dropped when max_tokens cut it
            return Parsed(text[:i] + ("" if cut else text[pos:]), calls, False) if calls or cut else \
                Parsed(text, [], False)
        if final and not calls:
            return Parsed(text, [], False)
        return Parsed(text[:i], calls)

    def tag(self, name: str, schema: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "arguments": ',
                "content": _json_content(schema), "end": "}"}

    def wrap(self, body: dict) -> dict:
        return {"type": "sequence", "elements": [{"type": "const_string", "value": "[TOOL_CALLS]["}, body,
                                                 {"type": "const_string", "value": "]"}]}

    def render_calls(self, calls: list[dict]) -> str:
        return "[TOOL_CALLS][" + ", ".join(
            f'{{"name": {json.dumps(c.get("function", c)["name"])}, "arguments": {_args_text(c)}}}'
            for c in calls) + "]"

    def example(self) -> str:
        return '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments>}}]'


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_parser(name: str) -> ToolParser:
    """Raises ValueError for an unknown format name."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (one of {', '.join(PARSERS)})") from None


class ToolCallStream:
    """Turns a streamed completion into OpenAI chat deltas: content as it settles, then one
    ``tool_calls`` delta per call once its JSON is complete (id, type, name and the whole
    arguments text; OpenAI's clients accumulate ``arguments`` across deltas, so one piece is
    a valid stream)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self.calls_sent: list[ToolCall] = []

    def feed(self, delta: str, final: bool = False, cut: bool = False,
             full: str | None = None) -> tuple[str, list[dict]]:
        """``(new content text, new tool_call deltas)`` after ``delta`` (``cut``: the output
        ended at max_tokens, so an unfinished call is dropped; ``full``: the whole text so far,
        which replaces what was fed when it is shorter: an output ended before text already
        fed, by ``stop_repeated_calls``)."""
        self.text += delta
        if full is not None and len(full) < len(self.text):
            self.text = full
        p = self.parser.parse(self.text, final, cut)
        content = p.content[self._content_sent:] if len(p.content) >= self._content_sent else ""
        self._content_sent = max(self._content_sent, len(p.content))
        out = []
        for k, c in enumerate(p.calls[len(self.calls_sent):], start=len(self.calls_sent)):
            self.calls_sent.append(c)
            out.append({"index": k, **c.to_openai()})
        return content, out


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except json.JSONDecodeError:
        return arguments


def repeat_cut(parser: ToolParser, text: str) -> int | None:
    """Where to end ``text`` when one of its complete calls repeats an earlier one (same name,
    same arguments as JSON): the length of the shortest prefix that holds every call before
    the repeat, or None when no call repeats.  A repeated call is a loop (a model that calls
    the same function with the same arguments twice in one turn learns nothing new)."""
    calls = parser.parse(text, final=False).calls
    seen: set[tuple[str, str]] = set()
    k = None
    for idx, c in enumerate(calls):
        key = (c.name, _canonical(c.arguments))
        if key in seen:
            k = idx
            break
        seen.add(key)
    if k is None:
        return None
    lo, hi = 0, len(text)  # complete calls only grow with the prefix: the shortest one holding k
    while lo < hi:
        mid = (lo + hi) // 2
        if len(parser.parse(text[:mid], final=False).calls) >= k:
            hi = mid
        else:
            lo = mid + 1
    return lo
