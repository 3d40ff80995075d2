"""An engine folder opened for serving: ``kiln serve --engine`` and ``LLM(engine=)`` read what
``kiln build`` wrote, without the original model.

The folder's layout and its verification (format version, completion marker, engine hash,
manifest and file checksums) are torch-free and shared with the build and the operator in
``kiln.common.manifest``; this module adds what needs torch: the model config, the
tokenizer, and loading the weights into a model runner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.common.manifest import EngineFormatError, verify_engine

from .model.config import ModelConfig


@dataclass
class EngineFolder:
    """An opened, verified engine folder (what ``kiln build`` wrote; see ``kiln.common.manifest``).

    Attributes:
        path: the folder.
        manifest: the parsed ``manifest.json``.
    """

    path: Path
    manifest: dict[str, Any]

    @property
    def model_config(self) -> ModelConfig:
        """The model's architecture settings as the manifest recorded them."""
        return ModelConfig.from_hf_dict(self.manifest["model"]["config"])

    @property
    def model_ref(self) -> str:
        """The source the engine was built from (``builtin:...``), for naming only."""
        return str(self.manifest.get("source", {}).get("ref") or self.path)

    @property
    def engine_hash(self) -> str:
        """The engine hash (the folder's content address)."""
        return str(self.manifest["engine_hash"])

    @property
    def kv_cache_dtype(self) -> str:
        """``auto`` (the model dtype) or ``fp8`` (the engine carries KV scales)."""
        return str(self.manifest.get("kv_cache_dtype", "auto"))

    def weight_files(self) -> list[Path]:
        """The safetensors shards, in the manifest's order."""
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
        from .distributed.shard import shard_tensor  # noqa: PLC0415

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
                    if runner.tp.enabled:  # engines are sharded at load (distributed.shard)
                        t = shard_tensor(model, name, t)
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


def open_engine(path: str | os.PathLike, verify: bool = True) -> EngineFolder:
    """Open and verify an engine folder (``kiln.common.manifest.verify_engine``).

    Args:
        path: the engine folder.
        verify: hash every weight file against the manifest (``kiln serve
            --no-verify-checksums`` turns it off).  Sizes are always checked.
    Raises:
        EngineFormatError: missing folder or manifest, another format version, an unfinished
            build, a manifest whose hash does not match its spec, a missing, truncated or
            modified weight file.
    """
    return EngineFolder(Path(path), verify_engine(path, verify_checksums=verify))
