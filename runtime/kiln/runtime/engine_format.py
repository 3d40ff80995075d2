"""The engine on disk: what ``kiln build`` writes and ``kiln serve --engine`` / ``LLM(engine=)``
reads, without the original model.

Layout of an engine folder (``<cache>/<engine hash>/``)::

    manifest.json        format version, engine hash, normalized build spec, model config,
                         quantization, KV cache dtype, build limits, weight files with sha256,
                         tokenizer files, source reference + sha256, calibration, builder
    model.safetensors    (or model-0000i-of-0000n.safetensors) Kiln's own parameter names
                         (fused qkv_proj / gate_up_proj), quantized buffers as the method
                         stores them, ``...attn.k_scale``/``v_scale`` for an FP8 KV cache
    tokenizer.json, tokenizer_config.json, ...
    .kiln-complete       written last, before the folder is renamed into place

``open_engine(path)`` checks the format version, the completion marker, the engine hash
against the recorded build spec, the manifest's own sha256 (``manifest_sha256``: model config,
quantization, file lists), and every weight and tokenizer file's size / sha256 (set
``KILN_ENGINE_VERIFY=0`` to skip the hashing on huge engines), and raises
``EngineFormatError`` with a message that says what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .enginespec import COMPLETE_MARKER, ENGINE_FORMAT_VERSION, MANIFEST_FILENAME, canonical_json
from .model.config import ModelConfig


class EngineFormatError(ValueError):
    """An engine folder that cannot be served: missing, half-written, another format version,
    or files whose checksum does not match the manifest."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
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


def spec_hash(build_spec: dict[str, Any], length: int = 16) -> str:
    """The engine hash of a manifest's normalized build spec (same rule as ``enginespec``)."""
    return hashlib.sha256(canonical_json(build_spec).encode()).hexdigest()[:length]


@dataclass
class Engine:
    """An opened, verified engine folder.

    Attributes:
        path: the folder.
        manifest: the parsed ``manifest.json``.
    """

    path: Path
    manifest: dict[str, Any]

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(self.manifest["model"]["config"])

    @property
    def model_ref(self) -> str:
        """The source the engine was built from (``builtin:...``), for naming only."""
        return str(self.manifest.get("source", {}).get("ref") or self.path)

    @property
    def engine_hash(self) -> str:
        return str(self.manifest["engine_hash"])

    @property
    def kv_cache_dtype(self) -> str:
        return str(self.manifest.get("kv_cache_dtype", "auto"))

    def weight_files(self) -> list[Path]:
        return [self.path / f["name"] for f in self.manifest["weights"]["files"]]

    def load_tokenizer(self):
        """The tokenizer saved in the engine (transformers fast tokenizer)."""
        from transformers import AutoTokenizer  # noqa: PLC0415

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except Exception as e:
            raise EngineFormatError(f"engine {self.path}: cannot load its tokenizer: {e}") from e

    def load_into(self, runner) -> None:
        """Load the engine's weights into a ``ModelRunner``'s freshly built model: quantized
        layers get their serving method, an FP8 KV cache its scales and the runner's KV
        dtype.

        Raises:
            EngineFormatError: a tensor the model lacks, or one the engine lacks.
        """
        import torch  # noqa: PLC0415
        from safetensors import safe_open  # noqa: PLC0415

        from .quantization import QuantSettings, convert_for_runtime  # noqa: PLC0415
        from .quantization import kv_fp8  # noqa: PLC0415

        model = runner.model
        convert_for_runtime(model, QuantSettings.from_manifest(self.manifest["quantization"]))
        targets = dict(model.state_dict(keep_vars=False))
        if model.config.tie_word_embeddings:
            targets.pop("lm_head.weight", None)
        kv_scales: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        for f in self.weight_files():
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    t = sf.get_tensor(name)
                    if name.endswith(".attn.k_scale") or name.endswith(".attn.v_scale"):
                        kv_scales[name] = t
                        continue
                    dst = targets.get(name)
                    if dst is None:
                        raise EngineFormatError(f"engine {self.path}: tensor {name!r} has no place in the model")
                    if dst.shape != t.shape:
                        raise EngineFormatError(
                            f"engine {self.path}: tensor {name!r} has shape {tuple(t.shape)}, model wants {tuple(dst.shape)}")
                    with torch.no_grad():
                        dst.copy_(t)
                    seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            raise EngineFormatError(f"engine {self.path}: lacks {len(missing)} tensors, e.g. {missing[:3]}")
        if self.kv_cache_dtype == "fp8":
            try:
                kv_fp8.install_scales(model, kv_scales, runner.device)
            except KeyError as e:
                raise EngineFormatError(f"engine {self.path}: FP8 KV cache scale {e} missing") from e
            runner.kv_cache_torch_dtype = kv_fp8.KV_DTYPE


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Parse ``manifest.json``.  Raises ``EngineFormatError`` when missing or malformed."""
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


def open_engine(path: str | os.PathLike, verify: bool | None = None) -> Engine:
    """Open and verify an engine folder.

    Args:
        path: the engine folder.
        verify: hash every weight file against the manifest (default: on, unless
            ``KILN_ENGINE_VERIFY=0``).  Sizes are always checked.
    Raises:
        EngineFormatError: missing folder or manifest, another format version, an unfinished
            build, a manifest whose hash does not match its spec, a missing, truncated or
            modified weight file.
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
    for key in ("engine_hash", "build_spec", "model", "quantization", "weights", "manifest_sha256"):
        if key not in m:
            raise EngineFormatError(f"engine {p}: manifest lacks {key!r}")
    h = str(m["engine_hash"])
    if len(h) < 16 or spec_hash(m["build_spec"], len(h)) != h:
        raise EngineFormatError(f"engine {p}: manifest's engine hash {h!r} does not match its build spec "
                                f"(edited or corrupt manifest); rebuild it")
    if manifest_digest(m) != m["manifest_sha256"]:
        raise EngineFormatError(f"engine {p}: manifest.json was modified after the build (its sha256 does not "
                                f"match manifest_sha256); rebuild it")
    if verify is None:
        verify = os.environ.get("KILN_ENGINE_VERIFY", "1") not in ("0", "false", "no")
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
        if verify and sha256_file(fp) != digest:
            raise EngineFormatError(f"engine {p}: checksum mismatch for {name} (sha256 differs from the "
                                    f"manifest: corrupt or modified engine); rebuild it")
    tok_sums = m.get("tokenizer_sha256") or {}
    if not isinstance(tok_sums, dict):
        raise EngineFormatError(f"engine {p}: malformed tokenizer_sha256 in the manifest; rebuild it")
    for name, digest in tok_sums.items():
        fp = p / str(name)
        if Path(str(name)).name != name or not fp.is_file():
            raise EngineFormatError(f"engine {p}: tokenizer file {name} is missing; rebuild it")
        if verify and sha256_file(fp) != digest:
            raise EngineFormatError(f"engine {p}: checksum mismatch for tokenizer file {name} (corrupt or "
                                    f"modified engine); rebuild it")
    return Engine(p, m)
