"""Kiln's own quantization beside llm-compressor's, in one run: perplexity on the shipped
held-out text of the embedded SmolLM2-135M-Instruct as Kiln engines built by Kiln's methods
(``fp8``, ``int8-smoothquant``, ``int4-gptq``, ``int4-awq``) and as llm-compressor checkpoints
(FP8_DYNAMIC; W8A8 by SmoothQuant + GPTQ; W4A16 by GPTQ) built into Kiln engines with
``--quantization auto`` (the numbers of docs/benchmarks.md, "Kiln's methods beside
llm-compressor").  A measurement script, not a test (CPU, tens of minutes on 2 cores):

    .venv/bin/python benchmarks/prequant_ppl.py --out /tmp/prequant [--samples 32] [--group-size 64]

Both sides calibrate on the same token samples (``calibration.calibration_samples``: the first
``--samples`` chunks of 128 tokens of the shipped calibration text).  SmolLM2's hidden size (576)
is not a multiple of 128, so the int4 rows use one group size for both (64 by default).
Finished steps are kept under ``--out`` and skipped on a rerun; ``results.json`` holds the table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def llmcompressor_checkpoints(hf: Path, out: Path, samples: list[list[int]], group: int, say,
                              wanted: set[str]) -> dict[str, Path]:
    """llm-compressor's three recipes on the float folder ``hf`` (its examples' settings:
    SmoothQuant strength 0.8, GPTQ on every Linear but the LM head, dampening 0.01)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM

    data = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
    w4 = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group))
    recipes = {
        "llmc-fp8-dynamic": QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]),
        "llmc-w8a8-sq-gptq": [SmoothQuantModifier(smoothing_strength=0.8),
                              GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])],
        f"llmc-w4a16-gptq-g{group}": GPTQModifier(config_groups={"group_0": w4}, ignore=["lm_head"]),
    }
    paths = {}
    for name, recipe in recipes.items():
        if name not in wanted:
            continue
        dest = out / name
        paths[name] = dest
        if (dest / "config.json").is_file():
            continue
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
        kw = {} if name == "llmc-fp8-dynamic" else dict(dataset=data, num_calibration_samples=len(samples),
                                                         max_seq_length=max(len(s) for s in samples))
        oneshot(model=model, recipe=recipe, **kw)
        model.save_pretrained(str(dest), save_compressed=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (hf / f).is_file():
                (dest / f).write_bytes((hf / f).read_bytes())
        say(f"{name}: {time.perf_counter() - t0:.0f} s")
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--only", default=None,
                    help="comma-separated rows to run (e.g. 'kiln fp8,kiln int8-smoothquant'); others are kept as "
                         "results.json has them")
    a = ap.parse_args()
    only = None if a.only is None else {n.strip() for n in a.only.split(",")}
    from kiln.common.enginespec import BuildSpec
    from kiln.runtime import loader
    from kiln.runtime.build import build_engine
    from kiln.runtime.eval import perplexity
    from kiln.runtime.quantization import calibration

    def say(m):
        print(f"[prequant_ppl] {m}", flush=True)

    a.out.mkdir(parents=True, exist_ok=True)
    hf = loader.materialize_gguf(loader.resolve_source(None))
    tok = loader.load_tokenizer(hf)
    samples = calibration.calibration_samples(tok, a.samples)
    g = a.group_size
    llmc_rows = {"llmc-fp8-dynamic", "llmc-w8a8-sq-gptq", f"llmc-w4a16-gptq-g{g}"}
    wanted = llmc_rows if only is None else {"llmc-" + n[len("llm-compressor "):] for n in only
                                             if n.startswith("llm-compressor ")}
    ckpts = llmcompressor_checkpoints(Path(hf.path), a.out, samples, g, say, wanted)
    builds = {"kiln fp8": (str(hf.path), dict(quantization="fp8")),
              "kiln int8-smoothquant": (str(hf.path), dict(quantization="int8-smoothquant")),
              f"kiln int4-gptq g{g}": (str(hf.path), dict(quantization="int4-gptq", group_size=g)),
              f"kiln int4-awq g{g}": (str(hf.path), dict(quantization="int4-awq", group_size=g))}
    builds |= {f"llm-compressor {n[5:]}": (str(p), dict(quantization="auto")) for n, p in ckpts.items()}
    results_path = a.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if "float32" not in results and (only is None or "float32" in only):
        results["float32"] = {"perplexity": perplexity(model=str(hf.path)).perplexity}
        results_path.write_text(json.dumps(results, indent=2))
    for name, (src, kw) in builds.items():
        if name in results or (only is not None and name not in only):
            continue
        t0 = time.perf_counter()
        spec = BuildSpec.from_cli(src, calibration_samples=a.samples, **kw)
        eng = build_engine(spec, src, a.out / "engines" / spec.hash(), device="cpu")
        secs = time.perf_counter() - t0
        res = perplexity(engine=str(eng.path))
        manifest = json.loads((eng.path / "manifest.json").read_text())
        results[name] = {"perplexity": res.perplexity, "tokens": res.num_tokens, "build_s": round(secs, 1),
                         "quantization": manifest["quantization"]}
        results = (json.loads(results_path.read_text()) if results_path.is_file() else {}) | results | {
            name: results[name]}  # another run of this script may have added rows meanwhile
        results_path.write_text(json.dumps(results, indent=2))
        say(f"{name}: perplexity {res.perplexity:.3f} (build {secs:.0f} s)")
    results = json.loads(results_path.read_text()) | results
    if "float32" not in results:
        return
    base = results["float32"]["perplexity"]
    print("| engine | perplexity | vs float32 |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / base - 1):+.2f}% |")
    results_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
