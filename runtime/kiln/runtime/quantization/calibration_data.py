"""Calibration and evaluation data: reading a file into records, rendering records into
token streams, and cutting streams into calibration samples.  Torch-free.

A data file is either

* **plain UTF-8 text** (any file that is not JSONL): one record of domain ``text``; or
* **JSONL** (name ending ``.jsonl``, or a first non-blank character ``{``): one JSON object a
  line, each with either ``"text": str`` or ``"messages": [{"role": str, "content": str}, ...]``
  (a chat, rendered through the tokenizer's chat template, as the server renders
  ``/v1/chat/completions``), and optionally ``"domain": str``; other keys (``source``, ...)
  are ignored.  Blank lines are skipped.

Samples (``samples_from_streams``): each domain's records are tokenized and concatenated (the
EOS token between records) into one stream, each stream is cut into ``sample_tokens`` chunks
(a tail of at least ``MIN_TAIL_TOKENS`` is kept), and the chunks are taken round-robin over
the domains in order of first appearance, so any number of samples covers every domain.

The default calibration data, ``data/calibration_mix.jsonl``, is written by
``tools/make_calibration_mix.py`` (its doc says what is in it and where each part comes from).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DEFAULT_CALIBRATION_FILE = "calibration_mix.jsonl"  # in kiln/runtime/data
HELDOUT_DIR = "heldout"  # in kiln/runtime/data: one file per evaluation domain
MIN_TAIL_TOKENS = 32  # a stream's last chunk is kept when it has at least this many tokens


class CalibrationDataError(ValueError):
    """A data file that cannot be used: missing, a folder, not UTF-8, empty, malformed JSONL
    (the message names the file and line)."""


@dataclass(frozen=True)
class Record:
    """One unit of data: ``text`` (plain) or ``messages`` (a chat), and its ``domain``."""

    domain: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None


def data_path(name: str) -> Path:
    """Path of a file or folder shipped in ``kiln/runtime/data``."""
    return Path(str(resources.files("kiln.runtime") / "data" / name))


def default_calibration_path() -> Path:
    """The shipped default calibration data."""
    return data_path(DEFAULT_CALIBRATION_FILE)


def sha256_of(path: str | Path) -> str:
    """``sha256:<hex>`` of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def _is_jsonl(path: Path, body: str) -> bool:
    return path.suffix.lower() == ".jsonl" or body.lstrip().startswith("{")


def _record(obj, where: str, default_domain: str) -> Record:
    if not isinstance(obj, dict):
        raise CalibrationDataError(f"{where}: expected a JSON object with \"text\" or \"messages\", "
                                   f"got {type(obj).__name__}")
    domain = obj.get("domain", default_domain)
    if not isinstance(domain, str) or not domain.strip():
        raise CalibrationDataError(f"{where}: \"domain\" must be a non-empty string")
    has_text, has_msgs = "text" in obj, "messages" in obj
    if has_text == has_msgs:
        raise CalibrationDataError(f"{where}: needs exactly one of \"text\" or \"messages\"")
    if has_text:
        if not isinstance(obj["text"], str) or not obj["text"].strip():
            raise CalibrationDataError(f"{where}: \"text\" must be a non-empty string")
        return Record(domain.strip(), text=obj["text"])
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise CalibrationDataError(f"{where}: \"messages\" must be a non-empty list")
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise CalibrationDataError(f"{where}: messages[{i}] needs string \"role\" and \"content\"")
    return Record(domain.strip(), messages=tuple({"role": m["role"], "content": m["content"]} for m in msgs))


def read_records(path: str | Path, default_domain: str | None = None) -> list[Record]:
    """The records of a data file (see the module doc for the formats).

    Args:
        path: the file.
        default_domain: the domain of records without one (default: ``text``).
    Raises:
        CalibrationDataError: a missing file, a folder, not UTF-8, no content, a line that is
            not JSON or not a valid record (the message names the file and line number).
    """
    p = Path(path)
    dom = default_domain or "text"
    if p.is_dir():
        raise CalibrationDataError(f"{p}: is a directory, not a data file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise CalibrationDataError(f"{p}: no such file") from None
    except OSError as e:
        raise CalibrationDataError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        body = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationDataError(f"{p}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    if not body.strip():
        raise CalibrationDataError(f"{p}: the file is empty")
    if not _is_jsonl(p, body):
        return [Record(dom, text=body)]
    records = []
    for n, line in enumerate(body.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationDataError(f"{p}: line {n}: not JSON ({e.msg} at column {e.colno})") from None
        records.append(_record(obj, f"{p}: line {n}", dom))
    if not records:
        raise CalibrationDataError(f"{p}: no records")
    return records


def record_token_ids(record: Record, tokenizer) -> list[int]:
    """Token ids of one record: plain text without special tokens, a chat through the
    tokenizer's chat template (no generation prompt: the whole conversation is data); a
    tokenizer without a chat template (a base model) gets the chat as ``role: content`` lines.
    """
    if record.text is not None:
        return list(tokenizer(record.text, add_special_tokens=False)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        plain = "\n".join(f"{m['role']}: {m['content']}" for m in record.messages)
        return list(tokenizer(plain, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(list(record.messages), tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def domain_streams(records: list[Record], tokenizer) -> dict[str, list[int]]:
    """Each domain's records tokenized and concatenated (EOS between records, when the
    tokenizer has one), domains in order of first appearance."""
    eos = getattr(tokenizer, "eos_token_id", None)
    streams: dict[str, list[int]] = {}
    for r in records:
        s = streams.setdefault(r.domain, [])
        if s and eos is not None:
            s.append(int(eos))
        s.extend(record_token_ids(r, tokenizer))
    return streams


def samples_from_streams(streams: dict[str, list[int]], num_samples: int,
                         sample_tokens: int) -> tuple[list[list[int]], dict[str, int]]:
    """Up to ``num_samples`` chunks of at most ``sample_tokens`` tokens, round-robin over the
    domains' streams.

    Returns:
        (samples, number of samples taken per domain).
    Raises:
        ValueError: ``num_samples`` or ``sample_tokens`` < 1.
    """
    if num_samples < 1:
        raise ValueError(f"calibration samples must be at least 1, got {num_samples}")
    if sample_tokens < 1:
        raise ValueError(f"sample tokens must be at least 1, got {sample_tokens}")
    chunked = {}
    for dom, ids in streams.items():
        chunks = [ids[i:i + sample_tokens] for i in range(0, len(ids), sample_tokens)]
        if chunks and len(chunks[-1]) < min(MIN_TAIL_TOKENS, sample_tokens) and len(chunks) > 1:
            chunks.pop()
        chunked[dom] = chunks
    out: list[list[int]] = []
    taken = {dom: 0 for dom in chunked}
    depth = 0
    while len(out) < num_samples and any(depth < len(c) for c in chunked.values()):
        for dom, chunks in chunked.items():
            if depth < len(chunks) and len(out) < num_samples:
                out.append(chunks[depth])
                taken[dom] += 1
        depth += 1
    return out, {d: n for d, n in taken.items() if n}


def heldout_domains() -> dict[str, Path]:
    """The shipped held-out evaluation texts, one per domain (``data/heldout/<domain>.*``),
    plus ``docstrings`` (``data/heldout.txt``), sorted by name."""
    found = {p.stem: p for p in data_path(HELDOUT_DIR).iterdir() if p.suffix in (".txt", ".jsonl")}
    found["docstrings"] = data_path("heldout.txt")
    return dict(sorted(found.items()))
