"""Randomly initialised EAGLE / EAGLE-3 heads in their published checkpoint layouts, shaped
for a given target model (no trained heads install here; tests and the H200 speculative
benchmark load these through ``--speculative-method eagle --speculative-model FOLDER``).

Layouts (the tensors of ``yuhuili/EAGLE-LLaMA3-Instruct-8B`` and
``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): EAGLE ``fc`` [H, 2H] + bias and ``layers.0.*``
without an input norm; EAGLE-3 ``fc`` [H, 3H], ``midlayer.*`` with q/k/v over 2H,
``midlayer.hidden_norm``, ``norm``, ``lm_head`` [draft vocab, H], ``d2t`` and ``t2d``.

    python benchmarks/eagle_heads.py --target-config CONFIG.json --kind eagle3 --output DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_random_head(folder, target: dict, kind: str, seed: int = 0, draft_vocab_size: int | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of a random ``kind`` head for the target
    whose ``config.json`` dict is ``target``; returns the folder."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    H, I, V = target["hidden_size"], target["intermediate_size"], target["vocab_size"]
    nh, nkv = target["num_attention_heads"], target.get("num_key_value_heads", target["num_attention_heads"])
    D = target.get("head_dim") or H // nh
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    cfg = {"architectures": ["LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLM"],
           "model_type": "llama", "hidden_size": H, "intermediate_size": I, "num_attention_heads": nh,
           "num_key_value_heads": nkv, "head_dim": D, "num_hidden_layers": 1, "vocab_size": V,
           "rms_norm_eps": target.get("rms_norm_eps", 1e-5), "rope_theta": target.get("rope_theta", 10000.0),
           "max_position_embeddings": target.get("max_position_embeddings", 2048), "hidden_act": "silu",
           "torch_dtype": "bfloat16"}
    if target.get("rope_scaling"):
        cfg["rope_scaling"] = target["rope_scaling"]
    pre = "midlayer." if kind == "eagle3" else "layers.0."
    qkv_in = 2 * H if kind == "eagle3" else H
    t = {f"{pre}self_attn.q_proj.weight": rnd(nh * D, qkv_in), f"{pre}self_attn.k_proj.weight": rnd(nkv * D, qkv_in),
         f"{pre}self_attn.v_proj.weight": rnd(nkv * D, qkv_in), f"{pre}self_attn.o_proj.weight": rnd(H, nh * D),
         f"{pre}mlp.gate_proj.weight": rnd(I, H), f"{pre}mlp.up_proj.weight": rnd(I, H),
         f"{pre}mlp.down_proj.weight": rnd(H, I), f"{pre}post_attention_layernorm.weight": ones(H)}
    if kind == "eagle3":
        dv = draft_vocab_size or max(1, V // 4)
        cfg["draft_vocab_size"] = dv
        ids = torch.randperm(V, generator=g)[:dv].sort().values
        t.update({"fc.weight": rnd(H, 3 * H), f"{pre}input_layernorm.weight": ones(H),
                  f"{pre}hidden_norm.weight": ones(H), "norm.weight": ones(H), "lm_head.weight": rnd(dv, H),
                  "d2t": ids - torch.arange(dv), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)})
    else:
        t.update({"fc.weight": rnd(H, 2 * H), "fc.bias": torch.zeros(H, dtype=torch.bfloat16)})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-config", required=True, help="the target model's config.json")
    p.add_argument("--kind", choices=["eagle", "eagle3"], default="eagle3")
    p.add_argument("--output", required=True)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    print(write_random_head(ns.output, json.loads(Path(ns.target_config).read_text()), ns.kind, ns.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
