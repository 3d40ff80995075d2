"""Random PEFT LoRA adapter folders for tests on the plane and of ``kiln adapter fetch``
(``adapter_config.json`` + ``adapter_model.safetensors`` as peft writes them, without peft).

The weights are random with a ``B`` large enough that the adapter changes greedy outputs of
the model it is shaped for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(cfg: Mapping) -> dict[str, tuple[int, int]]:
    """``hf module -> (in, out)`` of a Hugging Face Llama ``config.json`` dict."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_random_adapter(folder: Path, cfg: Mapping, rank: int = 8, targets: Sequence[str] = ALL_TARGETS,
                         seed: int = 0, scale: float = 1.0) -> Path:
    """Write a rank-``rank`` adapter of ``targets`` for the model of ``cfg`` (a config.json
    dict) into ``folder``; returns ``folder``."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            fin, fout = shapes[m]
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, fin, generator=g) / fin ** 0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * scale / rank ** 0.5
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets), "bias": "none",
        "lora_dropout": 0.0, "use_rslora": False, "task_type": "CAUSAL_LM"}))
    return folder
