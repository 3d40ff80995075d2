"""Writing builtin adapters (``kiln.common.adapterref.BuiltinAdapter``) as PEFT folders.

``random``: for every decoder layer and target module, ``lora_A`` [r, in] ~ N(0, 1/in) and
``lora_B`` [out, r] ~ N(0, 1/r) drawn from one CPU generator seeded with ``seed`` (layers in
order, targets in ``TARGETS`` order, A before B), stored as bfloat16 in
``adapter_model.safetensors`` under peft's names
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``) beside an
``adapter_config.json`` as peft writes it; ``peft.PeftModel.from_pretrained`` loads it.  With
these variances the delta ``B A x`` of a projection is about as large as its input ``x``
times ``alpha / r``: the default ``alpha = r`` changes greedy outputs, a smaller ``alpha``
nudges them.  The same parameters and base shapes give the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.common.adapterref import BuiltinAdapter

from .peft_format import CONFIG_FILE, WEIGHTS_FILE, module_shapes

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def builtin_tensors(ref: BuiltinAdapter, model_config) -> dict[str, torch.Tensor]:
    """The adapter's tensors (peft names, bfloat16) for a base of ``model_config``
    (``ModelConfig``)."""
    g = torch.Generator().manual_seed(ref.seed)
    shapes = module_shapes(model_config)
    out = {}
    for layer in range(model_config.num_hidden_layers):
        for m in ref.targets:
            fin, fout = shapes[m]
            pre = f"base_model.model.model.layers.{layer}.{'self_attn' if m in _ATTN else 'mlp'}.{m}"
            out[f"{pre}.lora_A.weight"] = (torch.randn(ref.rank, fin, generator=g) / fin ** 0.5).to(torch.bfloat16)
            out[f"{pre}.lora_B.weight"] = (torch.randn(fout, ref.rank, generator=g) / ref.rank ** 0.5).to(
                torch.bfloat16)
    return out


def write_builtin_adapter(folder: str | Path, ref: BuiltinAdapter, model_config) -> Path:
    """Write ``ref`` shaped for ``model_config`` into ``folder`` (created); returns it."""
    from safetensors.torch import save_file  # noqa: PLC0415

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(builtin_tensors(ref, model_config), str(folder / WEIGHTS_FILE))
    alpha = int(ref.alpha) if ref.alpha.is_integer() else ref.alpha
    (folder / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ref.rank, "lora_alpha": alpha,
        "target_modules": list(ref.targets), "bias": "none", "lora_dropout": 0.0, "use_rslora": False,
        "base_model_name_or_path": None, "inference_mode": True}, indent=2))
    return folder
