"""Pre-quantized checkpoints for the tests, made by the real producers where they install:

* compressed-tensors folders by llm-compressor (``oneshot`` with a ``QuantizationModifier``:
  FP8_DYNAMIC, W8A8, W4A16, W4A16_ASYM; data-free, seconds on a small model);
* GPTQ and AutoAWQ folders written per their published layouts from a W4A16 compressed-tensors
  checkpoint's own integer codes (GPTQModel needs transformers >= 5.20 and torch 2.15, AutoAWQ
  is archived and needs transformers 4: neither installs beside Kiln's lock), so each format
  holds the very weights transformers serves from the compressed-tensors folder.

The writers here follow the formats' documentation and reference packers (AutoGPTQ's
``QuantLinear.pack``, AutoAWQ's ``WQLinear_GEMM.from_linear``), with their own loops and none
of Kiln's code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column 8w + order[i]


def llmcompressor_checkpoint(src: Path, out: Path, scheme: str, group_size: int | None = None) -> Path:
    """``oneshot(QuantizationModifier(scheme))`` of the float folder ``src`` into ``out``
    (``save_compressed``), tokenizer files copied.  ``group_size`` overrides W4A16's 128."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    if group_size is None:
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    else:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(num_bits=4, type="int", symmetric=not scheme.endswith("ASYM"),
                                   strategy="group", group_size=group_size)
        recipe = QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                      ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(str(out), save_compressed=True)
    _copy_tokenizer(src, out)
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (Path(src) / f).exists():
            shutil.copy(Path(src) / f, Path(out) / f)


def _ct_int4(ct: Path):
    """``{linear prefix: (codes int [N, K] 0..15, zeros int [N, K/G] 0..15, scales float [N, K/G])}``
    and the float tensors of a W4A16 compressed-tensors folder, unpacked by compressed-tensors."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    t = load_file(str(ct / "model.safetensors"))
    lin, rest = {}, {}
    for name, v in t.items():
        if name.endswith(".weight_packed"):
            p = name[: -len(".weight_packed")]
            n, k = (int(x) for x in t[p + ".weight_shape"])
            q = unpack_from_int32(v, 4, torch.Size([n, k])).to(torch.int64) + 8
            s = t[p + ".weight_scale"]
            if p + ".weight_zero_point" in t:
                z = unpack_from_int32(t[p + ".weight_zero_point"], 4, torch.Size(s.shape), packed_dim=0).to(torch.int64) + 8
            else:
                z = torch.full(s.shape, 8, dtype=torch.int64)
            lin[p] = (q, z, s.float())
        elif not name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            rest[name] = v
    return lin, rest


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C] 0..15 -> int32 [R / 8, C]: row r in bits 4 (r % 8) of packed row r // 8 (AutoGPTQ's qweight)."""
    R, C = q.shape
    out = torch.zeros(R // 8, C, dtype=torch.int64)
    for j in range(8):
        out |= q[j::8].to(torch.int64) << (4 * j)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _pack_cols(q: torch.Tensor, order=None) -> torch.Tensor:
    """[R, C] 0..15 -> int32 [R, C / 8]: nibble i of word w holds column 8w + order[i]."""
    R, C = q.shape
    order = order or list(range(8))
    out = torch.zeros(R, C // 8, dtype=torch.int64)
    for i in range(8):
        out |= q[:, order[i]::8].to(torch.int64) << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def gptq_checkpoint(ct: Path, out: Path, sym: bool, checkpoint_format: str = "gptq") -> Path:
    """A GPTQ folder (``quant_method: gptq``, 4 bits, ``desc_act: false``) holding the codes of
    the W4A16 compressed-tensors folder ``ct``.  ``gptq`` stores each zero point minus one."""
    from safetensors.torch import save_file

    lin, rest = _ct_int4(ct)
    cfg = json.loads((ct / "config.json").read_text())
    gs = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    t = dict(rest)
    for p, (q, z, s) in lin.items():
        n, k = q.shape
        zs = z - (1 if checkpoint_format == "gptq" else 0)
        t[p + ".qweight"] = _pack_rows(q.t().contiguous())  # [K/8, N]
        t[p + ".qzeros"] = _pack_cols((zs & 0xF).t().contiguous())  # [K/G, N/8]
        t[p + ".scales"] = s.t().to(torch.float16).contiguous()
        t[p + ".g_idx"] = (torch.arange(k) // gs).to(torch.int32)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": False,
                                  "sym": sym, "checkpoint_format": checkpoint_format, "static_groups": False,
                                  "true_sequential": True, "damp_percent": 0.01}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(ct, out)
    return out


def awq_checkpoint(ct: Path, out: Path) -> Path:
    """An AutoAWQ GEMM folder (``quant_method: awq``, ``version: gemm``) holding the codes of
    the asymmetric W4A16 compressed-tensors folder ``ct``."""
    from safetensors.torch import save_file

    lin, rest = _ct_int4(ct)
    cfg = json.loads((ct / "config.json").read_text())
    gs = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    t = dict(rest)
    for p, (q, z, s) in lin.items():
        t[p + ".qweight"] = _pack_cols(q.t().contiguous(), AWQ_PACK_ORDER)  # [K, N/8]
        t[p + ".qzeros"] = _pack_cols(z.t().contiguous(), AWQ_PACK_ORDER)  # [K/G, N/8]
        t[p + ".scales"] = s.t().to(torch.float16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True,
                                  "version": "gemm", "modules_to_not_convert": None}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(ct, out)
    return out
