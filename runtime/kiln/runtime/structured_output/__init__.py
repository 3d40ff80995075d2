"""Structured output: grammars that constrain decoding (JSON schema, regex, choice, EBNF /
Lark, structural tags for tool calls), compiled by xgrammar (chosen over llguidance by the
per-token mask cost measured in ``docs/benchmarks.md``), token bitmasks filled on the host
and applied to the batch's logits on the device, and the tool-call parsers."""

from .spec import GrammarSpec, validate_spec  # noqa: F401
