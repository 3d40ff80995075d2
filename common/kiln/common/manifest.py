"""The engine folder's manifest: one reader and one verifier for ``kiln build``, ``kiln serve``
and the operator.

Layout of an engine folder (``<cache>/<engine hash>/``)::

    manifest.json        format version, engine hash, normalized build spec, model config,
                         quantization, KV cache dtype, build limits, weight files with sha256,
                         tokenizer files, source reference + sha256, calibration, builder
    model.safetensors    (or model-0000i-of-0000n.safetensors) Kiln's own parameter names
                         (fused qkv_proj / gate_up_proj), quantized buffers as the method
                         stores them, ``...attn.k_scale``/``v_scale`` for an FP8 KV cache
    tokenizer.json, tokenizer_config.json, ...
    .kiln-complete       written last, before the folder is renamed into place

``read_manifest(path)`` parses ``manifest.json``; ``verify_engine(path)`` checks the format
version, the completion marker, the engine hash against the recorded build spec, the
manifest's own sha256 (``manifest_sha256``: model config, quantization, file lists), and
every weight and tokenizer file's size and sha256; both raise ``EngineFormatError`` with a
message that says what to do.  ``is_engine_complete(path)`` is the cheap check (marker,
format version, hash) that never raises.  Opening the weights is the runtime's
(``kiln.runtime.engine_folder``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .constants import COMPLETE_MARKER, ENGINE_FORMAT_VERSION, HASH_LENGTH, MANIFEST_FILENAME
from .enginespec import canonical_json

__all__ = [
    "EngineFormatError",
    "sha256_file",
    "manifest_digest",
    "spec_hash",
    "read_manifest",
    "verify_engine",
    "is_engine_complete",
]

# Keys every finished engine's manifest has (``verify_engine`` refuses a manifest without one).
REQUIRED_KEYS = ("engine_hash", "build_spec", "model", "quantization", "weights", "manifest_sha256")


class EngineFormatError(ValueError):
    """An engine folder that cannot be served: missing, half-written, another format version,
    or files whose checksum does not match the manifest."""


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own ``manifest_sha256`` key: covers
    the model config, quantization settings and file lists that the engine hash does not."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    # Plain sorted-key JSON (the manifest holds floats, which canonical_json refuses; Python
    # writes a float's shortest round-trip repr, so parse -> dump gives the same text).
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def spec_hash(build_spec: dict[str, Any], length: int = HASH_LENGTH) -> str:
    """The engine hash of a manifest's normalized build spec (the rule of
    ``kiln.common.enginespec.BuildSpec.hash``)."""
    return hashlib.sha256(canonical_json(build_spec).encode()).hexdigest()[:length]


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Parse the ``manifest.json`` of the engine folder ``path``.

    Raises:
        EngineFormatError: the manifest is missing, unreadable, not JSON or not an object.
    """
    p = Path(path) / MANIFEST_FILENAME
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise EngineFormatError(f"{path} is not a Kiln engine: {MANIFEST_FILENAME} is missing (build one with kiln build)") from e
    except (OSError, ValueError) as e:
        raise EngineFormatError(f"engine {path}: cannot read {MANIFEST_FILENAME}: {e}") from e
    if not isinstance(data, dict):
        raise EngineFormatError(f"engine {path}: {MANIFEST_FILENAME} is not a JSON object")
    return data


def is_engine_complete(path: str | os.PathLike, expected_hash: str | None = None) -> bool:
    """True when ``path`` holds a finished engine of this format: the completion marker
    exists, ``manifest.json`` parses, its ``format_version`` is ``ENGINE_FORMAT_VERSION`` and,
    when ``expected_hash`` is given, its ``engine_hash`` starts with it.  Never raises."""
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        return False
    try:
        manifest = read_manifest(path)
    except EngineFormatError:
        return False
    if manifest.get("format_version") != ENGINE_FORMAT_VERSION:
        return False
    if expected_hash is not None:
        got = str(manifest.get("engine_hash", ""))
        if not (got.startswith(expected_hash) or expected_hash.startswith(got)) or not got:
            return False
    return True


def verify_engine(path: str | os.PathLike, verify_checksums: bool = True) -> dict[str, Any]:
    """Verify the engine folder ``path`` and return its manifest.

    Args:
        path: the engine folder.
        verify_checksums: hash every weight and tokenizer file against the manifest (sizes
            are always checked).
    Raises:
        EngineFormatError: missing folder or manifest, another format version, an unfinished
            build, a manifest whose hash does not match its spec or that was edited, a
            missing, truncated or modified weight or tokenizer file.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise EngineFormatError(f"engine {p} is a file, not an engine folder (the folder `kiln build --output` wrote)")
    if not p.is_dir():
        raise EngineFormatError(f"engine folder {p} does not exist")
    m = read_manifest(p)
    version = m.get("format_version")
    if version != ENGINE_FORMAT_VERSION:
        raise EngineFormatError(
            f"engine {p} has format version {version!r}, this Kiln reads version {ENGINE_FORMAT_VERSION}: "
            f"rebuild it with this Kiln's `kiln build` (or serve it with the Kiln that built it)")
    if not (p / COMPLETE_MARKER).is_file():
        raise EngineFormatError(f"engine {p} is incomplete ({COMPLETE_MARKER} missing): its build did not finish; rebuild it")
    for key in REQUIRED_KEYS:
        if key not in m:
            raise EngineFormatError(f"engine {p}: manifest lacks {key!r}")
    h = str(m["engine_hash"])
    if len(h) < HASH_LENGTH or spec_hash(m["build_spec"], len(h)) != h:
        raise EngineFormatError(f"engine {p}: manifest's engine hash {h!r} does not match its build spec "
                                f"(edited or corrupt manifest); rebuild it")
    if manifest_digest(m) != m["manifest_sha256"]:
        raise EngineFormatError(f"engine {p}: manifest.json was modified after the build (its sha256 does not "
                                f"match manifest_sha256); rebuild it")
    _verify_weight_files(p, m, verify_checksums)
    _verify_tokenizer_files(p, m, verify_checksums)
    return m


def _verify_weight_files(p: Path, m: dict[str, Any], verify_checksums: bool) -> None:
    """Every weight file the manifest lists is inside ``p`` with its size (and sha256)."""
    try:
        files = list(m["weights"]["files"])
        names = [str(f["name"]) for f in files]
        sizes = [int(f["bytes"]) for f in files]
        sums = [str(f["sha256"]) for f in files]
    except (TypeError, KeyError, ValueError) as e:
        raise EngineFormatError(f"engine {p}: malformed weights list in the manifest ({e!r}); rebuild it") from None
    if not files:
        raise EngineFormatError(f"engine {p}: the manifest lists no weight files; rebuild it")
    for name in names:
        if Path(name).name != name or name.startswith("."):
            raise EngineFormatError(f"engine {p}: weight file name {name!r} is not a file inside the engine folder")
    for name, nbytes, digest in zip(names, sizes, sums):
        fp = p / name
        if not fp.is_file():
            raise EngineFormatError(f"engine {p}: weight file {name} is missing; rebuild it")
        size = fp.stat().st_size
        if size != nbytes:
            raise EngineFormatError(f"engine {p}: weight file {name} has {size} bytes, manifest says "
                                    f"{nbytes} (truncated or modified); checksum mismatch, rebuild it")
        if verify_checksums and sha256_file(fp) != digest:
            raise EngineFormatError(f"engine {p}: checksum mismatch for {name} (sha256 differs from the "
                                    f"manifest: corrupt or modified engine); rebuild it")


def _verify_tokenizer_files(p: Path, m: dict[str, Any], verify_checksums: bool) -> None:
    """Every tokenizer file with a recorded sha256 is inside ``p`` (and matches it)."""
    tok_sums = m.get("tokenizer_sha256") or {}
    if not isinstance(tok_sums, dict):
        raise EngineFormatError(f"engine {p}: malformed tokenizer_sha256 in the manifest; rebuild it")
    for name, digest in tok_sums.items():
        fp = p / str(name)
        if Path(str(name)).name != name or not fp.is_file():
            raise EngineFormatError(f"engine {p}: tokenizer file {name} is missing; rebuild it")
        if verify_checksums and sha256_file(fp) != digest:
            raise EngineFormatError(f"engine {p}: checksum mismatch for tokenizer file {name} (corrupt or "
                                    f"modified engine); rebuild it")
