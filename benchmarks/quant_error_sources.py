"""Where the embedded default's quantization error comes from, per held-out domain: each
variant rounds the float32 model in memory (round to nearest, no calibration) and scores the
shipped domains with ``kiln eval``'s scorer (windows of 512), as a rise in perplexity.

    .venv/bin/python benchmarks/quant_error_sources.py [--max-tokens 1024] [--domains all]
        [--variants fp8-w,fp8-a,fp8-a-g64,fp8-wa,int4-g64,int4-g32,rot-int4-g64,rot-fp8-w,rot-fp8-a]
        [--sensitivity int4-g64]   # one linear type, then one decoder layer at a time
        [--keep-float layers.29.]  # linears whose name contains this stay float32

Variants: ``fp8-w`` E4M3 weights with one absmax scale per output channel; ``fp8-a`` E4M3
activations with one scale per token at every linear's input (``fp8-a-g64``: per 64 channels
of a token); ``int4-gN`` asymmetric int4 weights in groups of N (min/max); ``rot-*`` the same
after an orthogonal rotation of the residual stream folded into the weights (QuaRot's and
SpinQuant's R1: RMSNorm gains folded into the next linears, embeddings and the LM head
untied and rotated; the float model's outputs are unchanged).
"""

from __future__ import annotations

import argparse
import time

import torch

from kiln.runtime.eval import domain_texts, open_model, read_text, score_windows
from kiln.runtime.quantization.base import model_linears
from kiln.runtime.quantization.calibration_data import Record, domain_streams, read_records
from kiln.runtime.quantization.fp8 import fp8_round
from kiln.runtime.quantization.int4 import fake_quantize


def fp8_rows(t: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """``t`` [R, C] through E4M3 with one absmax scale per row (or per ``group`` columns)."""
    g = group or t.shape[1]
    v = t.float().reshape(t.shape[0], -1, g)
    s = v.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return fp8_round(v, s).reshape(t.shape)


WEIGHTS = {"fp8-w": fp8_rows, "fp8-wa": fp8_rows, "int4-g64": lambda w: fake_quantize(w, 64),
           "int4-g32": lambda w: fake_quantize(w, 32)}
ACTS = {"fp8-a": None, "fp8-wa": None, "fp8-a-g64": 64}


def rotate_residual(model, seed: int = 0) -> None:
    """Fold a random orthogonal rotation Q [D, D] of the residual stream into the weights."""
    d = model.config.hidden_size
    a = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diag(r))
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        head = (emb.double() * model.model.norm.weight.double()[None, :]) @ q
        emb.data = (emb.double() @ q).to(emb.dtype)
        model.lm_head.weight = torch.nn.Parameter(head.to(emb.dtype))
        model.model.norm.weight.data.fill_(1.0)
        for layer in model.model.layers:
            for norm, lin in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                              (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                lin.weight.data = ((lin.weight.double() * norm.weight.double()[None, :]) @ q).to(lin.weight.dtype)
                norm.weight.data.fill_(1.0)
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                lin.weight.data = (q.T @ lin.weight.double()).to(lin.weight.dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--domains", default="all")
    ap.add_argument("--variants", default="fp8-w,fp8-a,fp8-a-g64,fp8-wa,int4-g64,int4-g32,rot-int4-g64,rot-fp8-w,"
                                          "rot-fp8-a")
    ap.add_argument("--sensitivity", default=None, help="a weight variant to apply to one type / layer at a time")
    ap.add_argument("--keep-float", default=None, help="linears whose name contains this stay float32")
    a = ap.parse_args()
    torch.set_num_threads(1)
    eng = open_model(model="builtin:smollm2-135m-instruct", window=512)
    ids = {}
    for dom, f in domain_texts(a.domains).items():
        recs = read_records(f, default_domain=dom) if f.endswith(".jsonl") else [Record(dom, text=read_text(f))]
        ids[dom] = domain_streams([Record(dom, text=r.text, messages=r.messages) for r in recs],
                                  eng.tokenizer)[dom][:a.max_tokens]
    model = eng.runner.model

    def score() -> dict[str, float]:
        return {d: score_windows(eng, i, 512)[0].perplexity for d, i in ids.items()}

    base = score()
    print("float32 perplexity: " + ", ".join(f"{d} {p:.3f}" for d, p in base.items()), flush=True)
    state = {"rotated": False}

    def run(name: str, weights=None, act_group=False, only=None) -> None:
        lins = dict(model_linears(model))
        keep = {n: m.weight.data.clone() for n, m in lins.items()}
        hooks = []
        for n, m in lins.items():
            if only is not None and not only(n):
                continue
            if weights is not None:
                m.weight.data = weights(keep[n].float()).to(keep[n].dtype)
            if act_group is not False:
                hooks.append(m.register_forward_pre_hook(
                    lambda mod, args, g=act_group: (fp8_rows(args[0], g).to(args[0].dtype),)))
        t0 = time.perf_counter()
        got = score()
        for h in hooks:
            h.remove()
        for n, m in lins.items():
            m.weight.data = keep[n]
        print(f"{name:24s} " + " ".join(f"{d}:{(got[d] / base[d] - 1) * 100:+.2f}%" for d in got)
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)

    for v in [v for v in a.variants.split(",") if v]:
        plain = v.removeprefix("rot-")
        if v.startswith("rot-") and not state["rotated"]:
            rotate_residual(model)
            state["rotated"] = True
            rot = score()
            print("rotated float32 (check): " + " ".join(f"{d}:{(rot[d] / base[d] - 1) * 100:+.4f}%" for d in rot))
        if plain not in WEIGHTS and plain not in ACTS:
            raise SystemExit(f"unknown variant {v}")
        keep = None if a.keep_float is None else (lambda n: a.keep_float not in n)
        run(v + (f" ({a.keep_float} float)" if a.keep_float else ""), WEIGHTS.get(plain),
            ACTS.get(plain, False) if plain in ACTS else False, only=keep)
    if a.sensitivity:
        w = WEIGHTS[a.sensitivity]
        for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            run(f"{a.sensitivity} {kind}", w, only=lambda n, k=kind: n.endswith(k))
        for i in range(len(model.model.layers)):
            run(f"{a.sensitivity} layer {i}", w, only=lambda n, i=i: f"layers.{i}." in n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
