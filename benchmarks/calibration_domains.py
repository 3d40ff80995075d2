"""Per-domain accuracy of quantized engines: builds the embedded default with each method
through the real ``kiln build`` CLI, scores the float32 model and every engine on the shipped
held-out domains with ``kiln eval perplexity --domains``, and prints the markdown table of
``docs/benchmarks.md`` ("Accuracy per domain").

    .venv/bin/python benchmarks/calibration_domains.py --out /tmp/caldom [--samples 128]
        [--calibration-data FILE] [--jobs 2] [--max-tokens 2048] [--methods fp8,int4-awq]

Builds already present under ``--out`` are reused (the engine hash names them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = "builtin:smollm2-135m-instruct"
METHODS = {
    "fp8": ["--quantization", "fp8"],
    "int8-smoothquant": ["--quantization", "int8-smoothquant"],
    "int4-awq": ["--quantization", "int4-awq", "--group-size", "64"],
    "int4-gptq": ["--quantization", "int4-gptq", "--group-size", "64"],
}
GATES = {"fp8": 0.01, "int8-smoothquant": 0.03, "int4-awq": 0.08, "int4-gptq": 0.08}
KILN = [sys.executable, "-m", "kiln.runtime.cli"]


def run(cmd: list[str], log: Path) -> str:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env={**os.environ, "KILN_CPU_THREADS": "1"})
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}); see {log}")
    print(f"{log.stem}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return p.stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--calibration-data", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--methods", default=",".join(METHODS))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = [m for m in a.methods.split(",") if m]
    extra = ["--calibration-data", a.calibration_data] if a.calibration_data else []

    def build(m: str) -> Path:
        cmd = KILN + ["build", "--model", MODEL, *METHODS[m], "--calibration-samples", str(a.samples), *extra]
        h = subprocess.run(cmd + ["--output", "/unused", "--print-hash"], capture_output=True, text=True,
                           check=True).stdout.strip()
        eng = out / f"{m}-{h}"
        run(cmd + ["--output", str(eng), "--device", "cpu"], out / f"build-{m}.log")
        return eng

    def score(ref: list[str], name: str) -> dict:
        txt = run(KILN + ["eval", "perplexity", *ref, "--domains", "--json", "--max-tokens", str(a.max_tokens)],
                  out / f"eval-{name}.log")
        return json.loads(txt)["domains"]

    with ThreadPoolExecutor(a.jobs) as ex:
        base_f = ex.submit(score, ["--model", MODEL], "float32")
        engines = dict(zip(methods, ex.map(build, methods)))
        base = base_f.result()
        scores = dict(zip(methods, ex.map(lambda m: score(["--engine", str(engines[m])], m), methods)))
    (out / "results.json").write_text(json.dumps({"float32": base, **scores}, indent=2))
    doms = list(base)
    print("| engine | " + " | ".join(doms) + " |")
    print("|---|" + "---|" * len(doms))
    print("| float32 (perplexity) | " + " | ".join(f"{base[d]['perplexity']:.3f}" for d in doms) + " |")
    for m in methods:
        cells = []
        for d in doms:
            rise = scores[m][d]["perplexity"] / base[d]["perplexity"] - 1
            cells.append(f"{rise:+.2%}" + ("" if rise <= GATES[m] else " **missed**"))
        print(f"| {m} (gate +{GATES[m]:.0%}) | " + " | ".join(cells) + " |")
    print("tokens scored: " + ", ".join(f"{d} {base[d]['num_tokens']}" for d in doms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
