"""Incremental detokenization with stop strings.

Text grows one token at a time; a token whose bytes do not yet form complete UTF-8 shows
up as U+FFFD, so new text is released only once the decoded tail no longer ends with it
(the prefix/read-offset scheme of Hugging Face TGI and vLLM).  Stop strings are matched on
the text, also across token boundaries; the stream holds back the last
``max(len(stop)) - 1`` characters so a stop string is never emitted, even partly.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Prompt tokens kept as left context so the first generated tokens decode with the right
# leading spaces (SentencePiece / byte-level BPE merges depend on the left neighbour).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Detokenizes one completion.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the prompt (its last tokens give left context).
        skip_special_tokens: drop special tokens from the text.
        stop: stop strings (not included in the text).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A fast (Rust-backed) transformers tokenizer decodes through its ``tokenizers``
        # object: the same text (transformers adds only the optional clean-up of spaces,
        # off here) for a quarter of the per-call cost, which is paid twice per token.
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if isinstance(backend, Tokenizer) else None
        self.stop = [s for s in (stop or []) if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        ctx = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._ids: list[int] = list(ctx)
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self.text = ""
        self._emitted = 0  # characters of ``text`` already handed to the stream

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a generated token; ``check_stop=False`` skips the stop strings (before
        ``min_tokens``).

        Returns:
            The stop string that matched (the text is then cut before it), else None.
        """
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        else:
            new = ""
        if not new:
            return None
        start = max(0, len(self.text) - self._holdback)
        self.text += new
        if not check_stop:
            return None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1:
                self.text = self.text[:idx]
                return s
        return None

    def flush(self) -> None:
        """At the end, release any bytes still held as an incomplete character."""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            tail = full[len(prefix) :].replace("\ufffd", "")
            self.text += tail
            self._read_offset = len(self._ids)
            for s in self.stop:
                idx = self.text.find(s)
                if idx != -1:
                    self.text = self.text[:idx]

    def take_delta(self, finished: bool) -> str:
        """The text not yet streamed that is safe to stream now (everything, when finished)."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
