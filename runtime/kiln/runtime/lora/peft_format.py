"""Reading LoRA adapters in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``) and checking them against the base model.

A PEFT LoRA (Hu et al., 2021) adds ``scaling * B @ A`` to a linear's weight: ``A`` is
``lora_A.weight`` [r, in], ``B`` is ``lora_B.weight`` [out, r], ``scaling`` is
``lora_alpha / r`` (``alpha / sqrt(r)`` with rsLoRA, Kalajievo, 2023).  Tensor names look
like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``.  Torch-only; no
``peft`` import (the tests make adapters with ``peft`` and compare).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InvalidRequestError

#: Target modules Kiln can serve, per Hugging Face module name: (fused module, slice).
TARGET_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served (HTTP 400; a CLI error with exit 2).  ``reason`` is
    a short CamelCase word for conditions: ``NotFound``, ``InvalidAdapter``,
    ``RankTooLarge``, ``ShapeMismatch``."""

    def __init__(self, message: str, reason: str = "InvalidAdapter"):
        super().__init__(message)
        self.reason = reason


@dataclass
class LoRAWeights:
    """One adapter's tensors on the host, the scaling already folded into ``B``.

    Fields:
        rank: the adapter's ``r``.
        scaling: ``alpha / r`` (or rsLoRA's ``alpha / sqrt(r)``), folded into ``b``.
        a: ``(layer, hf module) -> A`` float32 [r, in].
        b: ``(layer, hf module) -> scaling * B`` float32 [out, r].
    """

    rank: int
    scaling: float
    a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.a})

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def module_shapes(cfg) -> dict[str, tuple[int, int]]:
    """``hf module -> (in_features, out_features)`` of the unsharded base model."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if folder.exists() and not folder.is_dir():
        raise LoRAError(f"adapter path {folder} is a file: it must be a PEFT adapter folder holding {CONFIG_FILE} "
                        f"and {WEIGHTS_FILE}", "InvalidAdapter")
    if not folder.is_dir():
        raise LoRAError(f"adapter folder {folder} does not exist", "NotFound")
    if not path.is_file():
        raise LoRAError(f"adapter folder {folder} has no {CONFIG_FILE}", "NotFound")
    if not (folder / WEIGHTS_FILE).is_file():
        raise LoRAError(f"adapter folder {folder} has no {WEIGHTS_FILE} (only safetensors adapters are served)",
                        "NotFound")
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(conf, dict):
        raise LoRAError(f"{path}: expected a JSON object")
    return conf


def _check_config(conf: dict, folder: Path, max_rank: int) -> tuple[int, float]:
    """``(r, scaling)`` of a PEFT LoRA config, or LoRAError for what Kiln cannot serve."""
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{folder}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("rank_pattern", "rank_pattern"),
                      ("alpha_pattern", "alpha_pattern"), ("layers_to_transform", "layers_to_transform")):
        if conf.get(key):
            raise LoRAError(f"{folder}: {what} adapters are not supported")
    if conf.get("bias", "none") != "none":
        raise LoRAError(f"{folder}: LoRA bias {conf.get('bias')!r} is not supported (only 'none')")
    r = conf.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{folder}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAError(f"{folder}: rank {r} is larger than --max-lora-rank {max_rank}; raise "
                        f"--max-lora-rank to {r} or more (at most 64)", "RankTooLarge")
    alpha = conf.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{folder}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    return r, float(scaling)


def _check_rank(folder: Path, name: str, shape: tuple, want: tuple, ab: str, r: int, max_rank: int) -> None:
    """A tensor whose base dimension fits but whose rank dimension is not the config's ``r``:
    the adapter's files disagree (``InvalidAdapter``), or its real rank is above ``max_rank``
    (``RankTooLarge``).  Other shape differences are the caller's (``ShapeMismatch``)."""
    if len(shape) != 2:
        return
    rank_dim, base_dim = (0, 1) if ab == "A" else (1, 0)
    if shape[base_dim] != want[base_dim] or shape[rank_dim] == r:
        return
    got = shape[rank_dim]
    if got > max_rank:
        raise LoRAError(f"{folder}: {name} has rank {got} (shape {shape}), larger than --max-lora-rank {max_rank}; "
                        f"raise --max-lora-rank to {got} or more", "RankTooLarge")
    raise LoRAError(f"{folder}: {name} has rank {got} (shape {shape}) but {CONFIG_FILE} says r={r}: the adapter's "
                    "config and weights do not belong together")


def load_peft_adapter(path: str | Path, model_config, max_rank: int) -> LoRAWeights:
    """Read and check one PEFT LoRA adapter folder.

    Args:
        path: the folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        model_config: the base model's ``ModelConfig`` (layer count and projection shapes).
        max_rank: ``--max-lora-rank``.
    Returns:
        The adapter's tensors (float32, on the host), scaling folded into ``B``.
    Raises:
        LoRAError: a missing folder or file (``NotFound``), a rank above ``max_rank``
            (``RankTooLarge``), tensors whose shapes do not fit the base (``ShapeMismatch``),
            an unsupported module or option (``InvalidAdapter``).
    """
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    folder = Path(path)
    conf = _read_config(folder)
    r, scaling = _check_config(conf, folder, max_rank)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"{folder / WEIGHTS_FILE}: not a readable safetensors file ({e})") from None
    shapes = module_shapes(model_config)
    out = LoRAWeights(rank=r, scaling=scaling)
    for name, t in tensors.items():
        m = _NAME.search(name)
        if m is None:
            raise LoRAError(f"{folder}: tensor {name!r} is not a LoRA A/B weight of a decoder layer projection")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise LoRAError(f"{folder}: target module {module!r} is not supported (supported: "
                            f"{', '.join(TARGET_MODULES)})")
        if layer >= model_config.num_hidden_layers:
            raise LoRAError(f"{folder}: tensor {name!r} is for layer {layer}, the base model has "
                            f"{model_config.num_hidden_layers} layers", "ShapeMismatch")
        fin, fout = shapes[module]
        want = (r, fin) if ab == "A" else (fout, r)
        _check_rank(folder, name, tuple(t.shape), want, ab, r, max_rank)
        if tuple(t.shape) != want:
            raise LoRAError(f"{folder}: {name} has shape {tuple(t.shape)}, the base model needs {want} (rank {r}): "
                            "the adapter was trained for another base model", "ShapeMismatch")
        if ab == "A":
            out.a[(layer, module)] = t.float()
        else:
            out.b[(layer, module)] = t.float() * scaling
    if not out.a:
        raise LoRAError(f"{folder}: no LoRA weights found")
    if set(out.a) != set(out.b):
        missing = sorted(set(out.a) ^ set(out.b))[:3]
        raise LoRAError(f"{folder}: lora_A and lora_B tensors do not pair up (e.g. {missing})")
    return out
