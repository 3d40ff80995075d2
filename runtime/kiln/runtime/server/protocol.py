"""OpenAI request bodies (pydantic) and their translation to :class:`SamplingParams`.

Field names and meanings follow OpenAI's Completions and Chat Completions APIs, plus the
extra sampling fields vLLM accepts (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``) and its
structured-output fields (``structured_outputs``, ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``) beside OpenAI's ``response_format``."""

from __future__ import annotations

from typing import Any, Literal, Union

import json

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from ..structured_output.spec import legacy_structural_tag


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


# vLLM's request extensions that this server does not implement, with the value that means
# "not used": a request that sets one to anything else gets a 400 naming it instead of being
# served as if it had not (unknown fields of no known meaning are still ignored, as OpenAI's).
_UNSUPPORTED_EXTENSIONS: dict[str, object] = {
    "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
    "prompt_logprobs": None, "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": None,
    "spaces_between_special_tokens": True,
}
_UNSUPPORTED_CHAT_EXTENSIONS: dict[str, object] = {
    "continue_final_message": False, "add_generation_prompt": True, "chat_template": None,
    "chat_template_kwargs": None, "echo": False, "documents": None, "mm_processor_kwargs": None,
}


class _SamplingFields(BaseModel):
    # extra: kept only to refuse the extensions above; strict: JSON types as OpenAI's API
    # takes them ("max_tokens": "2" or 2.5 or true is a 400, an integer is a valid number)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured output: OpenAI's, then vLLM's spellings (at most one may be given)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for, or None.

        Raises:
            ValueError (-> HTTP 400): more than one is given, a malformed ``response_format``,
                or a backend other than xgrammar.
        """
        if self.guided_decoding_backend not in (None, "", "auto", "xgrammar"):
            raise ValueError(f"guided_decoding_backend {self.guided_decoding_backend!r}: this server uses xgrammar")
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                found.append(("response_format", StructuredOutputsParams(json_object=True)))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
                    raise ValueError("response_format json_schema needs json_schema.schema (a JSON schema object)")
                found.append(("response_format", StructuredOutputsParams(json=js["schema"])))
            elif kind == "structural_tag":
                tag = json.dumps(legacy_structural_tag(rf), ensure_ascii=False)
                found.append(("response_format", StructuredOutputsParams(structural_tag=tag)))
            elif kind != "text":
                raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema, "
                                 "structural_tag")
        if self.structured_outputs is not None:
            so = dict(self.structured_outputs)
            for k in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "backend", "_backend", "_backend_was_auto"):
                so.pop(k, None)  # vLLM's backend options: this server has one backend
            tag = so.get("structural_tag")
            if isinstance(tag, str):
                try:
                    tag = json.loads(tag)
                except json.JSONDecodeError:
                    pass  # xgrammar's message, at validation
            if isinstance(tag, dict):
                so["structural_tag"] = json.dumps(legacy_structural_tag(tag), ensure_ascii=False)
            unknown = sorted(set(so) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs: unknown field {', '.join(map(repr, unknown))} (the fields are "
                                 f"{', '.join(StructuredOutputsParams.__dataclass_fields__)})")
            try:
                found.append(("structured_outputs", StructuredOutputsParams(**so)))
            except ValueError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                         ("guided_grammar", "grammar")):
            v = getattr(self, name)
            if v is not None:
                found.append((name, StructuredOutputsParams(**{kw: v})))
        if len(found) > 1:
            raise ValueError(f"give one output constraint, not {', '.join(n for n, _ in found)}")
        return found[0][1] if found else None

    def _refuse_unsupported(self, table: dict[str, object]) -> None:
        """ValueError (-> HTTP 400) for a vLLM extension of ``table`` set to a value other than
        its no-op one."""
        extra = self.model_extra or {}
        used = [k for k, noop in table.items() if k in extra and extra[k] != noop]
        if used:
            raise ValueError(f"{', '.join(used)}: not supported by this server")

    def _sampling(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int | None) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) for out-of-range values and for vLLM extensions this
        server does not implement."""
        self._refuse_unsupported(_UNSUPPORTED_EXTENSIONS)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options applies only with stream: true")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens or 0,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            structured_outputs=self.structured(),
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids, or a list of token-id lists."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self, default_max_tokens: int | None = 16) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) for out-of-range values and for what this server
        does not do (``best_of`` above ``n``, ``suffix``, ``echo`` with ``logprobs``)."""
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) different from n ({self.n}) is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs (prompt logprobs) is not supported")
        tooling = sorted({"tools", "tool_choice"} & set(self.model_extra or {}))
        if tooling:
            raise ValueError(f"{', '.join(tooling)}: tool calling is served on /v1/chat/completions, not on "
                             "/v1/completions")
        return self._sampling(self.max_tokens, self.logprobs, default_max_tokens)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt(s) as a list; raises ValueError for an empty one."""
        p = self.prompt
        if isinstance(p, str):
            out: list[Any] = [p]
        elif not p:
            raise ValueError("prompt must not be empty")
        elif isinstance(p[0], int):
            out = [p]
        else:
            out = list(p)
        for x in out:
            if (isinstance(x, str) and x == "") or (isinstance(x, list) and not x):
                raise ValueError("prompt must not be empty")
        return out


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to this call

    def text(self) -> str:
        """The message's text; parts of type "text" are concatenated.  Raises ValueError
        for non-text parts (this runtime serves text models), a text part without a string
        ``text``, and a missing/null content outside assistant messages (OpenAI allows a
        null content only on an assistant message that carries tool calls)."""
        if self.content is None:
            if self.role != "assistant":
                raise ValueError(f"a {self.role} message needs a content (a string or a list of text parts)")
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"unsupported content part type {part.get('type')!r}: only text is supported")
            if not isinstance(part.get("text"), str):
                raise ValueError('a content part of type "text" needs a string "text" field')
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    # Accepted so that a request using them is refused with a reason, not silently ignored.
    functions: list[dict[str, Any]] | None = None  # the older spelling of tools
    function_call: Union[str, dict[str, Any], None] = None

    def to_sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) for out-of-range values and for what this server
        does not do: the legacy ``functions`` / ``function_call`` (use ``tools``), and vLLM's
        chat-template extensions (``continue_final_message``, ``chat_template``, ...).  Tools
        are checked by ``kiln.runtime.server.tools``."""
        self._refuse_unsupported(_UNSUPPORTED_CHAT_EXTENSIONS)
        if self.functions or self.function_call not in (None, "none", "auto"):
            raise ValueError("functions / function_call (the legacy spelling) are not supported: use tools "
                             "and tool_choice")
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if (self.max_completion_tokens is not None and isinstance(self.min_tokens, int)
                and self.min_tokens > self.max_completion_tokens >= 0):
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_completion_tokens "
                             f"({self.max_completion_tokens})")
        lp = (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}")
        return self._sampling(mt, lp, default_max_tokens)

    def conversation(self) -> list[dict[str, Any]]:
        """Messages for the chat template: text contents, an assistant turn's ``tool_calls``
        (arguments as JSON text, as OpenAI sends them) and a tool turn's ``tool_call_id``."""
        conv = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None and role == "tool":
                msg["name"] = m.name
            conv.append(msg)
        return conv


class GenerateRequest(BaseModel):
    """Triton's generate extension (``POST /v2/models/{name}/generate[_stream]``): the inputs
    of TensorRT-LLM's ensemble by name, as top-level fields, or inside ``parameters``
    (KServe's spelling).  Unknown fields are refused (a misspelt setting must not be
    silently ignored)."""

    model_config = ConfigDict(extra="forbid")

    text_input: str
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    random_seed: int | None = None  # TensorRT-LLM's name for seed
    stop: Union[str, list[str], None] = None
    stop_words: Union[str, list[str], None] = None  # TensorRT-LLM's name for stop
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stream: bool | None = None
    parameters: dict[str, Any] | None = None

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "GenerateRequest":
        """Merge ``parameters`` into the top level (top-level fields win); raises
        pydantic's ValidationError for unknown or mistyped fields."""
        params = body.get("parameters")
        if isinstance(params, dict):
            body = {**params, **{k: v for k, v in body.items() if k != "parameters"}}
        return cls.model_validate(body)

    def to_sampling_params(self) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) for out-of-range values."""
        if self.seed is not None and self.random_seed is not None and self.seed != self.random_seed:
            raise ValueError("seed and random_seed differ: give one")
        stops: list[str] = []
        for s in (self.stop, self.stop_words):
            stops += [s] if isinstance(s, str) else list(s or [])
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=-1 if self.top_k == 0 else self.top_k, min_p=self.min_p,
            seed=self.seed if self.seed is not None else self.random_seed, stop=stops,
            min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos)


# --- responses -----------------------------------------------------------------------------
# msgspec structs, encoded straight to JSON bytes (one SSE chunk per generated token makes the
# encoder part of the serving path).  Fields without a default are always present, as
# OpenAI's clients expect (``"finish_reason": null`` while a choice runs).


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage_of(prompt_tokens: int, completion_tokens: int) -> Usage:
    """OpenAI's ``usage`` object (tokens)."""
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class CompletionResponse(msgspec.Struct):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionChunk(msgspec.Struct):
    """One SSE event of a streamed completion."""

    id: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    object: str = "text_completion"


class CompletionUsageChunk(msgspec.Struct):
    """The last event of a stream with ``stream_options.include_usage``."""

    id: str
    created: int
    model: str
    usage: Usage
    choices: list[CompletionStreamChoice] = []
    object: str = "text_completion"


class ChatMessageOut(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatToolCallsMessageOut(msgspec.Struct):
    """An assistant message with tool calls (``content`` null when there is no text)."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: Any  # ChatMessageOut | ChatToolCallsMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(msgspec.Struct):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: dict[str, Any]
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    """One SSE event of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    object: str = "chat.completion.chunk"


class ChatUsageChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    usage: Usage
    choices: list[ChatStreamChoice] = []
    object: str = "chat.completion.chunk"


class GenerateResponse(msgspec.Struct):
    """Triton's ``generate`` answer."""

    model_name: str
    model_version: str
    text_output: str
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int


class GenerateChunk(msgspec.Struct):
    """One SSE event of Triton's ``generate_stream``."""

    model_name: str
    model_version: str
    text_output: str
    finish_reason: str | None
