"""Which int4 algorithm for the LM head: the embedded SmolLM2 with a float32 body and only its
LM head quantized, perplexity on the shipped held-out text (the numbers of docs/benchmarks.md,
"Quantization" -> "LM head quantized too").  A measurement script, not a test (CPU, ~5 min):

    KILN_CPU_THREADS=1 .venv/bin/python tests/build/lm_head_algorithms.py [--group-size 32] [--samples 32]

Statistics of the head's inputs come from the float model's final-norm outputs on the
calibration text (``LayerwiseCalibrator.collect_lm_head``); the algorithms are the ones
``AwqHandler.quantize_lm_head`` and ``GptqHandler.quantize_lm_head`` run, plus round to nearest
and AWQ's clipping search alone.
"""

from __future__ import annotations

import argparse
import json

import torch

from kiln.runtime.eval import open_model, read_text, score_windows
from kiln.runtime.quantization import awq, calibration, gptq, int4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--samples", type=int, default=32)
    a = ap.parse_args()
    G = a.group_size
    eng = open_model(model="builtin:smollm2-135m-instruct", window=512)
    model = eng.runner.model
    head, norm = model.lm_head, model.model.norm
    ids = list(eng.tokenizer(read_text(None), add_special_tokens=False)["input_ids"])
    cal = calibration.LayerwiseCalibrator(model, calibration.calibration_samples(eng.tokenizer, a.samples))
    for i in range(len(model.model.layers)):
        cal.advance(i)
    st = cal.collect_lm_head(frozenset({"absmean", "samples", "hessian"}))
    W = head.weight.detach().float().clone()
    norm_w = norm.weight.detach().clone()

    def score(name: str) -> None:
        print(json.dumps({"head": name, "group_size": G, "perplexity": score_windows(eng, ids, 512)[0].perplexity}),
              flush=True)

    def store(w, s, z, q=None) -> None:
        int4.store_int4(head, int4.quantize_with(w, s, z, G) if q is None else q, s, z, G)

    def restore() -> None:  # float head and norm again (fresh buffers: the CPU dequant cache follows them)
        for n in ("qweight", "scales", "qzeros"):
            head._buffers.pop(n, None)
        head.weight = torch.nn.Parameter(W.clone(), requires_grad=False)
        head.quant_method = None
        norm.weight.data.copy_(norm_w)

    with torch.no_grad():
        score("float32")
        store(W, *int4.quantize_params(W, G))
        score("round to nearest")
        restore()
        store(W, *awq.search_clip(st.samples, W, G))
        score("AWQ clipping search only")
        restore()
        s = awq.search_scale(st.samples, st.absmean, W, G)
        norm.weight.div_(s)
        store(W * s, *awq.search_clip(st.samples / s, W * s, G))
        score("AWQ scale + clipping search (int4-awq)")
        restore()
        q, s, z = gptq.gptq_quantize(W, st.hessian, G)
        store(W, s, z, q)
        score("GPTQ (int4-gptq)")


if __name__ == "__main__":
    main()
