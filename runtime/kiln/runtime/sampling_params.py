"""Per-request generation settings (the names and meanings of vLLM's / OpenAI's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5

#: Largest ``n`` and ``logprobs`` a request may ask for.
MAX_N = 16
MAX_LOGPROBS = 20


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``); exactly one is set.

    Attributes:
        json: a JSON schema (dict, or JSON text).
        json_object: any JSON object (OpenAI's ``response_format: {type: json_object}``).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (``root ::= ...``) or Lark (``start: ...``) grammar.
        structural_tag: an xgrammar structural tag (JSON text; the tool-call formats).

    Raises:
        ValueError: none or more than one is set, or one has the wrong type.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            import json as _json  # noqa: PLC0415

            self.json = _json.dumps(self.json, ensure_ascii=False)
        set_ = [n for n in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, n) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError("structured output needs exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag; got {', '.join(set_) or 'none'}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"structured output {name} must be a string, got {type(v).__name__}")

    def spec(self):
        """The :class:`~kiln.runtime.structured_output.spec.GrammarSpec` to compile.

        Raises:
            ValueError: a malformed schema or choice list.
        """
        from .structured_output import spec as S  # noqa: PLC0415

        if self.json is not None:
            return S.json_spec(self.json)
        if self.json_object:
            return S.GrammarSpec("json_object")
        if self.regex is not None:
            return S.GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return S.choice_spec(self.choice)
        if self.grammar is not None:
            return S.grammar_spec(self.grammar)
        return S.GrammarSpec("structural_tag", self.structural_tag)


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        n: number of independent completions of the prompt (distinct samples), 1..MAX_N.
        max_tokens: generated tokens at most; None = up to the context length.
        temperature: 0 (or below 1e-5) = greedy; otherwise divides logits before sampling.
        top_k: keep the k most likely tokens (-1 or 0 = all).
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al., 2020).
        min_p: drop tokens whose probability is below ``min_p * p_max`` (0 = off).
        seed: per-request RNG seed; the same seed gives the same tokens.
        presence_penalty / frequency_penalty: OpenAI's additive penalties on generated tokens.
        repetition_penalty: CTRL's multiplicative penalty (Keskar et al., 2019) on prompt and
            generated tokens; 1.0 = off.
        stop: strings that end generation when they appear in the text (not included).
        stop_token_ids: token ids that end generation (not included in the text).
        min_tokens: generate at least this many tokens before EOS, ``stop_token_ids`` or a
            stop string may end the output (EOS and stop ids are masked out of the logits
            until then; vLLM's ``min_tokens``).
        logit_bias: ``{token_id: bias}`` added to the logits before sampling (-100..100).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: also return this many top log-probabilities per generated token (of the
            model's raw distribution, before penalties and temperature); None = off.
        skip_special_tokens: drop special tokens from the text.
        detokenize: build text (and match stop strings); False returns token ids only.
        structured_outputs: constrain the output to a schema, regex, choice or grammar
            (:class:`StructuredOutputsParams`); None = free text.

    Raises:
        ValueError: on out-of-range values; the message carries the offending value.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: return token ids only (benchmarks, models without a tokenizer).
    detokenize: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias; -100..100).
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured output (the grammar decides where "
                             "the output may end)")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in ("n", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and not isinstance(self.max_tokens, bool) and isinstance(self.max_tokens, int) \
                and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_tokens is not None and not isinstance(self.max_tokens, bool) and isinstance(self.max_tokens, int) \
                and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        if self.stop is not None and (not isinstance(self.stop, (str, list, tuple)) or (
                not isinstance(self.stop, str) and not all(isinstance(s, str) for s in self.stop))):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)):
            raise ValueError(f"logprobs must be an integer (top log-probabilities per token), got {self.logprobs!r}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict {{token_id: bias}}, got {self.logit_bias!r}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if len(self.stop) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(self.stop)}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (use stop_token_ids to stop on token ids)")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.logit_bias:
            bias = {}
            for k, v in dict(self.logit_bias).items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                if tid < 0 or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {k!r}: {v!r}")
                bias[tid] = float(v)
            self.logit_bias = bias
        else:
            self.logit_bias = None

    @property
    def greedy(self) -> bool:
        """True for argmax sampling: temperature below ``SAMPLING_EPS`` (dividing logits by
        a tiny temperature would overflow them; vLLM uses the same cut) or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
