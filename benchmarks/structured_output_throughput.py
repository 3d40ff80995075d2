"""Throughput cost of constrained decoding: generated tokens/s at batch 1 and 64 with and
without a JSON schema, offline (``LLM``), same prompts, same lengths.

    .venv/bin/python benchmarks/structured_output_throughput.py                 # embedded SmolLM2, CPU
    python benchmarks/structured_output_throughput.py --model builtin:llama-3.2-1b --load-format dummy \\
        --batch-sizes 1,64 --max-tokens 128                                      # the H200

With ``--load-format dummy`` the builtin shape-only models use Kiln's synthetic byte-level
tokenizer (its whole 128256-token vocabulary), so the masks are the real size; the schema
(an object with a long array of free strings) keeps every row constrained for all
``--max-tokens`` steps.  Prints one line per (batch, constrained) with tokens/s and the cost
in percent.
"""

from __future__ import annotations

import argparse
import time

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "items": {"type": "array", "items": {"type": "string"}, "minItems": 64},
}, "required": ["title", "items"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default=None)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.sampling_params import StructuredOutputsParams

    kw = {"model": a.model} if a.model else {}
    if a.load_format:
        kw["load_format"] = a.load_format
    llm = LLM(**kw)
    prompt = [{"role": "user", "content": "List things as JSON."}]
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        rates = {}
        for constrained in (False, True):
            so = StructuredOutputsParams(json=SCHEMA) if constrained else None
            params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=not constrained,
                                    structured_outputs=so)
            llm.chat([prompt], params)  # warm-up (and the grammar's compile)
            best = 0.0
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                outs = llm.chat([prompt] * bs, params)
                dt = time.perf_counter() - t0
                ntok = sum(len(o.outputs[0].token_ids) for o in outs)
                best = max(best, ntok / dt)
            rates[constrained] = best
            print(f"batch {bs:3d} constrained={constrained!s:5}  {best:9.1f} tokens/s", flush=True)
        print(f"batch {bs:3d} cost of constraining: {100 * (1 - rates[True] / rates[False]):5.1f} %", flush=True)


if __name__ == "__main__":
    main()
