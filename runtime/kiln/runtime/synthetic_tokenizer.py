"""A deterministic synthetic tokenizer for the shape-only builtins (``builtin:llama-3.1-8b``,
``builtin:llama-3.2-1b`` with ``--load-format dummy``), so a benchmark of random weights does
the serving path's real text work: incremental detokenization and one SSE chunk per token.

It is a real byte-level BPE (GPT-2's byte-to-unicode alphabet, the ``tokenizers`` library),
built programmatically rather than trained: the 256 byte tokens, then generated merges, each
making a new token from two earlier ones (word-like pieces: a space-prefixed word start plus
lowercase letters, letter pieces, a few digit runs) until every id below ``vocab_size`` is a
token.  The config's BOS and EOS ids are special tokens at exactly those ids.  So every id
decodes (mostly to ASCII words), random ids make text of a plausible length, and any text
encodes and decodes back exactly.  A pseudo-random generator with a fixed seed makes the
tokenizer the same on every machine; ``FORMAT_VERSION`` changes when the construction does.

Building 128k merges takes a few seconds, so ``synthetic_tokenizer`` writes the result once
under ``<cache dir>/tokenizers/`` (atomically: a temporary folder, then rename) and later
calls load the saved files.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

FORMAT_VERSION = 1  # bump when the construction (and so the token ids' text) changes
_SEED = 20261202
_MAX_TOKEN_CHARS = 12  # longest generated token (characters of the byte-level alphabet)
_SPACE = "\u0120"  # "Ġ": the byte-level alphabet's space
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (the
    byte-level alphabet that ``tokenizers``' ByteLevel pre-tokenizer and decoder use)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def special_tokens(bos_token_id: int | None, eos_token_ids: list[int]) -> dict[int, str]:
    """``{id: spelling}`` of the special tokens: ``<|bos|>``, then ``<|eos|>`` for the first
    EOS id and ``<|eos_N|>`` for the others."""
    out: dict[int, str] = {}
    if bos_token_id is not None:
        out[bos_token_id] = "<|bos|>"
    for i, t in enumerate(eos_token_ids):
        out.setdefault(t, "<|eos|>" if i == 0 else f"<|eos_{i}|>")
    return out


def generate_merges(num_merges: int, seed: int = _SEED) -> list[tuple[str, str]]:
    """``num_merges`` BPE merges ``(a, b)`` over the byte-level alphabet, each making the new
    token ``a + b`` from two tokens that exist before it (a byte or an earlier merge's result),
    no token made twice.  Deterministic for a seed."""
    rng = random.Random(seed)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    # weights roughly like English letter frequencies, so pieces look like words
    freq = [8, 2, 3, 4, 12, 2, 2, 6, 7, 1, 1, 4, 2, 7, 8, 2, 1, 6, 6, 9, 3, 1, 2, 1, 2, 1]
    caps = [c.upper() for c in letters]
    digits = [str(d) for d in range(10)]
    seen = set(bytes_to_unicode().values())
    pieces: list[str] = []  # letter pieces (no leading space), any length
    short: list[str] = letters[:]  # letter pieces of at most 3 characters: the usual right half
    starts: list[str] = [_SPACE]  # word starts: a space and letters
    numbers: list[str] = digits[:]
    merges: list[tuple[str, str]] = []

    def add(a: str, b: str) -> bool:
        t = a + b
        if t in seen or len(t) > _MAX_TOKEN_CHARS:
            return False
        seen.add(t)
        merges.append((a, b))
        return True

    # the word starts of single letters first: " a" .. " z", " A" .. " Z"
    for c in letters + caps:
        if len(merges) < num_merges and add(_SPACE, c):
            starts.append(_SPACE + c)
    cap_starts = [_SPACE + c for c in caps] + caps
    while len(merges) < num_merges:
        r = rng.random()
        if r < 0.45:  # a word start grows: "Ġth" + "e"
            a = rng.choice(starts) if rng.random() < 0.7 else rng.choice(starts[:64])
            b = rng.choices(letters, freq)[0] if rng.random() < 0.5 else rng.choice(short)
            if add(a, b):
                starts.append(a + b)
        elif r < 0.85:  # a letter piece: "in" + "g"
            a = rng.choice(pieces) if pieces and rng.random() < 0.5 else rng.choices(letters, freq)[0]
            b = rng.choices(letters, freq)[0] if rng.random() < 0.6 else rng.choice(short)
            if add(a, b):
                pieces.append(a + b)
                if len(a + b) <= 3:
                    short.append(a + b)
        elif r < 0.95:  # a capitalized word (start): "ĠT" + "he"
            a, b = rng.choice(cap_starts), rng.choice(short)
            if add(a, b):
                starts.append(a + b)
        else:  # digit runs: "19" + "9"
            a, b = rng.choice(numbers), rng.choice(digits)
            if add(a, b):
                numbers.append(a + b)
    return merges


def tokenizer_json(vocab_size: int, bos_token_id: int | None, eos_token_ids: list[int]) -> dict:
    """The ``tokenizer.json`` document of the synthetic tokenizer (a plain dict).

    Ids: the config's BOS/EOS ids are special tokens; every other id below ``vocab_size``
    is, in order, a byte token (256 of them) or a merge's result.

    Raises:
        ValueError: a special id outside ``[0, vocab_size)``, or a vocabulary too small for
            the 256 byte tokens and the special tokens.
    """
    specials = special_tokens(bos_token_id, eos_token_ids)
    bad = [t for t in specials if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"special token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    num_regular = vocab_size - len(specials)
    if num_regular < 256:
        raise ValueError(f"a byte-level tokenizer needs at least {256 + len(specials)} ids, the vocabulary has "
                         f"{vocab_size}")
    merges = generate_merges(num_regular - 256)
    tokens = [bytes_to_unicode()[b] for b in range(256)] + [a + b for a, b in merges]
    free_ids = (i for i in range(vocab_size) if i not in specials)
    vocab = {t: i for t, i in zip(tokens, free_ids)}
    # Special tokens are in the model's vocabulary too: ``tokenizers`` gives an added token the
    # id it has there (else the next free id, whatever ``added_tokens`` says).
    vocab.update({s: i for i, s in specials.items()})
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in sorted(specials.items())]
    bos = specials.get(bos_token_id) if bos_token_id is not None else None
    post = None
    if bos is not None:  # Llama 3's: BOS before every encoded text
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [bos_token_id], "tokens": [bos]}}}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }


def build_tokenizer(vocab_size: int, bos_token_id: int | None, eos_token_ids: list[int]):
    """The synthetic tokenizer as a transformers ``PreTrainedTokenizerFast`` (built now, not
    cached; ``synthetic_tokenizer`` caches).  Raises ValueError as ``tokenizer_json``."""
    from tokenizers import Tokenizer  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    specials = special_tokens(bos_token_id, eos_token_ids)
    tok = Tokenizer.from_str(json.dumps(tokenizer_json(vocab_size, bos_token_id, eos_token_ids)))
    eos = specials[eos_token_ids[0]] if eos_token_ids else None
    extra = [s for i, s in specials.items() if s not in ("<|bos|>", eos)]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials.get(bos_token_id) if bos_token_id is not None else None,
        eos_token=eos, additional_special_tokens=extra, chat_template=_CHAT_TEMPLATE,
        model_max_length=1 << 30, clean_up_tokenization_spaces=False)


def cache_name(vocab_size: int, bos_token_id: int | None, eos_token_ids: list[int]) -> str:
    """The cache folder's name: the format version, the vocabulary size and the special ids."""
    eos = ".".join(map(str, eos_token_ids)) or "none"
    return f"synthetic-bpe-v{FORMAT_VERSION}-vocab{vocab_size}-bos{bos_token_id}-eos{eos}"


def synthetic_tokenizer(vocab_size: int, bos_token_id: int | None, eos_token_ids: list[int], cache_dir: Path):
    """The synthetic tokenizer for a vocabulary, loaded from ``cache_dir/tokenizers/<name>``
    (``cache_name``) and built and saved there first when missing.  A cache that cannot be
    written (read-only home) only costs the build on every call.

    Args:
        vocab_size: the model's vocabulary (ids ``[0, vocab_size)``).
        bos_token_id: the config's BOS id, or None.
        eos_token_ids: the config's EOS ids (the first is the tokenizer's ``eos_token``).
        cache_dir: Kiln's cache root (``loader.cache_root()``).
    Raises:
        ValueError: as ``tokenizer_json``.
    """
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    dest = Path(cache_dir) / "tokenizers" / cache_name(vocab_size, bos_token_id, eos_token_ids)
    if (dest / "tokenizer.json").is_file() and (dest / "tokenizer_config.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(dest))
    tok = build_tokenizer(vocab_size, bos_token_id, eos_token_ids)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    except OSError:
        return tok
    try:
        tok.save_pretrained(str(tmp))
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race; its copy is the same
            pass
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
