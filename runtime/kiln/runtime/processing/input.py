"""The input processor: prompts and chats -> validated :class:`CoreRequest` sequences.

Tokenization, chat templates and every check that needs only the model's limits run here,
in the API process (or in-process for ``LLM``), so the engine core only ever sees requests
that fit.  Text written in chat messages stays text: a special token's spelling inside a
message (``<|im_end|>``, ``<|start_header_id|>``...) is tokenized as plain characters, so a
user cannot forge a system turn.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Any

from ..engine_core.messages import CoreRequest
from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from .output import child_id


def mix_seed(seed: int, index: int) -> int:
    """The generator seed of completion ``index`` of a request seeded with ``seed`` (int64):
    SplitMix64's finalizer (Steele, Lea and Flood 2014) over ``seed + index * golden ratio``,
    so seeds that differ only in their high 32 bits (which torch's CPU generator drops) or by
    one completion index still give unrelated streams.  Returns an int in [0, 2**64)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)


@dataclass(frozen=True)
class ModelLimits:
    """What the input processor checks requests against (from the engine core).

    Fields: ``max_model_len`` (tokens), ``vocab_size``, ``block_size`` (tokens per KV block),
    ``num_kv_blocks`` (the KV pool), ``served_model_name``.
    """

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    served_model_name: str


# Marks a message's content in a rendered chat template; control characters that no chat
# template emits and no tokenizer's special token contains.
_MARK = "\x1e\x1fkiln{}\x1f\x1e"
_MARK_RE = re.compile("\x1e\x1fkiln(\\d+)\x1f\x1e")


class InputProcessor:
    """Tokenizes and validates requests.

    Args:
        tokenizer: a transformers tokenizer, or None (token-id prompts only).
        limits: the served model's limits.
    """

    def __init__(self, tokenizer, limits: ModelLimits):
        self.tokenizer = tokenizer
        self.limits = limits
        self._max_token_chars: int | None = None  # longest vocabulary entry (characters), lazily
        self._special: list[str] | None = None  # spellings of the tokenizer's special tokens

    # -- prompts ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)``; strings are encoded as ``tokenizer(prompt)`` would.

        Raises:
            InvalidRequestError: no tokenizer, invalid Unicode, or text certainly too long.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids as the prompt")
            self._check_text_length(len(prompt))
            _check_unicode(prompt, "the prompt")
            try:
                return prompt, list(self.tokenizer.encode(prompt))
            except Exception as e:  # e.g. a lone UTF-16 surrogate the tokenizer cannot encode
                raise InvalidRequestError(f"the prompt cannot be tokenized (invalid Unicode?): {e}") from e
        return None, [int(t) for t in prompt]

    def _check_text_length(self, num_chars: int) -> None:
        """Refuse, without tokenizing it, text that cannot fit the context: no token covers more
        than ``L`` characters, L the longest vocabulary entry (twice that, for decoders that add
        characters), so ``num_chars > max_model_len * 2L`` means more tokens than the context.

        Raises:
            InvalidRequestError: the text is certainly too long.
        """
        if self._max_token_chars is None:
            try:
                self._max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
            except Exception:  # a tokenizer without a vocabulary listing: no early check
                self._max_token_chars = 0
        n = self.limits.max_model_len
        if self._max_token_chars and num_chars > n * 2 * self._max_token_chars:
            raise InvalidRequestError(
                f"this model's maximum context length is {n} tokens, but the prompt has "
                f"{num_chars} characters, more than {n} tokens of this tokenizer can hold")

    # -- chats -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a chat, rendered with the tokenizer's chat template (with ``tools``,
        OpenAI's tool definitions, passed to it when given); special-token spellings inside
        message contents are tokenized as text.

        Raises:
            InvalidRequestError: malformed messages, no chat template, or text certainly
                longer than the context.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(f"model {self.limits.served_model_name} has no chat template")
        self._check_text_length(sum(len(str(m.get("content") or "")) for m in messages))
        for i, m in enumerate(messages):
            _check_unicode(str(m.get("content") or ""), f"messages[{i}].content")
        kw = {"tools": tools} if tools else {}
        if not any(self._has_special(str(m.get("content") or "")) for m in messages):
            return self._render_ids(messages, kw)
        return self._render_ids_protected(messages, kw)

    @property
    def template_supports_tools(self) -> bool:
        """The chat template reads ``tools`` (else the tools are described in a system turn)."""
        tmpl = getattr(self.tokenizer, "chat_template", None) or ""
        return "tools" in (tmpl if isinstance(tmpl, str) else str(tmpl))

    def _render_ids(self, messages: list[dict[str, Any]], kw: dict[str, Any]) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
        except Exception as e:
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _has_special(self, text: str) -> bool:
        if self._special is None:
            toks = getattr(self.tokenizer, "all_special_tokens", None) or []
            added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            self._special = sorted({*toks, *(str(t) for t in added.values() if getattr(t, "special", False))} - {""})
        return any(s in text for s in self._special)

    def _render_ids_protected(self, messages: list[dict[str, Any]], kw: dict[str, Any]) -> list[int]:
        """Render with each content replaced by a marker, then tokenize the template's own
        text normally and each content with ``split_special_tokens`` (special-token spellings
        become ordinary tokens)."""
        marked = [{**m, "content": _MARK.format(i)} if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False, **kw)
        except Exception as e:
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
        ids: list[int] = []
        pos = 0
        for m in _MARK_RE.finditer(text):
            if m.start() > pos:
                ids += self.tokenizer.encode(text[pos:m.start()], add_special_tokens=False)
            content = messages[int(m.group(1))]["content"]
            if content:
                ids += self.tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            pos = m.end()
        if pos < len(text):
            ids += self.tokenizer.encode(text[pos:], add_special_tokens=False)
        return ids

    # -- validation --------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model's limits; returns the effective max_tokens.

        Raises:
            InvalidRequestError: empty prompt, prompt or prompt+max_tokens beyond the
                context, token ids outside the vocabulary, a prompt larger than the KV pool.
        """
        lim = self.limits
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n >= lim.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {lim.max_model_len} tokens, but the prompt has "
                f"{n} tokens (at least one token must remain for the completion)")
        vocab = lim.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        for what, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        max_tokens = params.max_tokens if params.max_tokens is not None else lim.max_model_len - n
        if n + max_tokens > lim.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {lim.max_model_len} tokens; the prompt has {n} tokens "
                f"and max_tokens is {max_tokens}, {n + max_tokens} in total")
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens this request can generate "
                f"(maximum context length {lim.max_model_len}, prompt {n} tokens)")
        need = -(-(n + 1) // lim.block_size)
        if need > lim.num_kv_blocks:
            raise InvalidRequestError(
                f"the prompt needs {need} KV blocks but the cache has only {lim.num_kv_blocks}")
        return max_tokens

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float | None = None,
                lora_name: str | None = None) -> tuple[str | None, list[int], list[CoreRequest]]:
        """Tokenize and validate one request and fan it out into its ``n`` core sequences
        (computed by the LoRA adapter ``lora_name`` when given; the core resolves it).

        Returns:
            ``(prompt text or None, prompt token ids, core requests)``.
        Raises:
            InvalidRequestError: the request cannot be served (nothing is queued).
        """
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(ids, params)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs a tokenizer; this model has none")
            check_structured_outputs(params.structured_outputs)
        if self.tokenizer is None and (params.detokenize or params.stop):
            if params.stop:
                raise InvalidRequestError("stop strings need a tokenizer; this model has none")
            params.detokenize = False
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [CoreRequest(request_id=child_id(request_id, i), prompt_token_ids=ids, params=params,
                            max_tokens=max_tokens, arrival_time=arrival,
                            seed=(mix_seed(params.seed, i) if params.seed is not None and not params.greedy else None),
                            record_metrics=i == 0, lora_name=lora_name)
                for i in range(params.n)]
        return text, ids, seqs


def check_structured_outputs(so) -> None:
    """Raises InvalidRequestError (-> HTTP 400) with the grammar engine's message when the
    schema, regex or grammar of ``so`` (``StructuredOutputsParams``) does not compile; the
    verdicts of the last 1024 specs are kept."""
    try:
        spec = so.spec()
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    err = _spec_error(spec)
    if err:
        raise InvalidRequestError(err)


@functools.lru_cache(maxsize=1024)
def _spec_error(spec) -> str | None:
    from ..structured_output.spec import validate_spec  # noqa: PLC0415

    try:
        validate_spec(spec)
    except ValueError as e:
        return str(e)
    return None


def _check_unicode(text: str, what: str) -> None:
    """Raises InvalidRequestError for text that is not valid Unicode (a lone UTF-16
    surrogate from a JSON ``\\ud800`` escape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} is not valid Unicode: a lone surrogate "
                                  f"{text[e.start]!r} at character {e.start}") from None
