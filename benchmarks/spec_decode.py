"""Speculative decoding speedups, per method and batch size, against decoding without drafts
in the same run, on a copy-heavy workload (``kiln bench --dataset copy``: repeat a passage).

For each method one engine is loaded; the same engine with its speculation taken away is the
baseline (plain decoding, its CUDA graphs included), run interleaved with the speculative runs.  Speculation is kept on at every batch size
measured, so the table shows where it stops paying: the batch size to switch it off above (``--speculative-disable-by-batch-size``).
Random weights (``--load-format dummy``) give near-zero acceptance for draft models and EAGLE
heads (those runs measure the cost of drafting); n-gram on a copy workload still finds
matches where the model repeats itself.

    PYTHONPATH=common:runtime:kernels python3 benchmarks/spec_decode.py \
        --methods ngram,draft --draft-model /tmp/engines/smollm2-awq --batch-sizes 1,4 --output-len 64
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _free(llm) -> None:
    import torch

    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(llm, wl_by_batch: dict, reps: int = 2) -> tuple[dict, dict, dict]:
    """``run_kiln_offline`` per batch size with the engine's speculation removed (plain
    decoding), on at every step (a fixed switch-off size), and with the default measured
    switch-off (``spec_decode.switch_off``, one instance kept across runs as in a server),
    interleaved ``reps`` times; the best run of each (a shared machine's noise only ever slows
    a run down).  Returns ``(off, on, auto)`` by batch size."""
    from kiln.runtime.bench import run_kiln_offline
    from kiln.runtime.spec_decode.switch_off import SwitchOff

    core = llm.engine.core
    runner = llm.engine.runner
    spec, sink = core.spec, runner.hidden_sink
    fixed = spec.switch_off
    auto_policy = SwitchOff(spec.config.max_batch_size, adaptive=True)
    off, on, auto = {}, {}, {}
    try:
        for _ in range(reps):
            for b, wl in wl_by_batch.items():
                core.spec, runner.hidden_sink = None, None
                r = run_kiln_offline(llm, wl)
                off[b] = max(off.get(b, r), r, key=lambda x: x["output_tok_s"])
                core.spec, runner.hidden_sink = spec, sink
                for policy, best in ((fixed, on), (auto_policy, auto)):
                    spec.switch_off = policy
                    r = run_kiln_offline(llm, wl)
                    best[b] = max(best.get(b, r), r, key=lambda x: x["output_tok_s"])
    finally:
        core.spec, runner.hidden_sink, spec.switch_off = spec, sink, fixed
    return off, on, auto


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="the target (default: the embedded default)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--methods", default="ngram,draft,eagle")
    p.add_argument("--draft-model", default=None, help="draft: a model source or an engine folder "
                   "(default: the target itself, an upper bound of acceptance)")
    p.add_argument("--eagle-head", default=None, help="eagle: a head folder (default: a random EAGLE-3 head)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=2, help="interleaved off/on runs per batch size (best kept)")
    p.add_argument("--label", default=None, help="the model's name in the output")
    p.add_argument("--json", default=None)
    ns = p.parse_args()

    from kiln.runtime import LLM
    from kiln.runtime.bench_common import make_copy_workload

    batches = [int(b) for b in ns.batch_sizes.split(",")]
    methods = [m for m in ns.methods.split(",") if m]
    base = dict(model=ns.model, load_format=ns.load_format, device=ns.device, max_model_len=ns.max_model_len,
                num_kv_blocks=ns.num_kv_blocks, max_num_seqs=max(max(batches), 8),
                num_speculative_tokens=ns.num_speculative_tokens,
                speculative_disable_by_batch_size=max(batches))
    label = ns.label or ns.model or "builtin:smollm2-135m-instruct"
    rows = []
    for method in methods:
        kw = dict(base, speculative_method="ngram" if method == "ngram" else method)
        if method == "draft":
            kw["speculative_model"] = ns.draft_model or ns.model or "builtin:smollm2-135m-instruct"
        elif method == "eagle":
            head = ns.eagle_head
            if head is None:
                from eagle_heads import write_random_head
                from kiln.runtime import loader

                src = loader.materialize_gguf(loader.resolve_source(ns.model))
                head = str(write_random_head(tempfile.mkdtemp(prefix="eagle3-"),
                                             loader.load_model_config(src).to_hf_dict(), "eagle3"))
            kw["speculative_model"] = head
        t0 = time.perf_counter()
        llm = LLM(**kw)
        print(f"[spec] {label}: {method} engine loaded in {time.perf_counter() - t0:.0f}s", flush=True)
        wls = {b: make_copy_workload(llm.tokenizer, b, ns.input_len, ns.output_len, seed=b) for b in batches}
        baseline, spec, measured = measure(llm, wls, ns.reps)
        for b in batches:
            off, on = baseline[b], spec[b]
            rows.append({"model": label, "method": method, "batch": b, "off_tok_s": off["output_tok_s"],
                         "spec_tok_s": on["output_tok_s"], "speedup": on["output_tok_s"] / off["output_tok_s"],
                         "auto_tok_s": measured[b]["output_tok_s"],
                         "auto_speedup": measured[b]["output_tok_s"] / off["output_tok_s"],
                         "auto_rates": measured[b].get("spec_switch_off_rates"),
                         "acceptance": on.get("spec_acceptance_rate"),
                         "mean_accepted_length": on.get("spec_mean_accepted_length"),
                         "acceptance_per_position": on.get("spec_acceptance_per_position")})
            r = rows[-1]
            print(f"[spec] {label} {method:5s} batch {b:3d}: off {r['off_tok_s']:8.1f} tok/s, spec "
                  f"{r['spec_tok_s']:8.1f} tok/s, speedup {r['speedup']:.2f}x, acceptance {r['acceptance']:.3f}, "
                  f"mean accepted length {r['mean_accepted_length']:.2f}; measured switch-off "
                  f"{r['auto_tok_s']:8.1f} tok/s ({r['auto_speedup']:.2f}x)", flush=True)
        _free(llm)
    print(f"\n{'model':32s} {'method':6s} {'batch':>5s} {'off tok/s':>10s} {'spec tok/s':>10s} {'speedup':>8s} "
          f"{'accept':>7s} {'mean len':>8s} {'auto tok/s':>10s} {'auto':>7s}")
    for r in rows:
        print(f"{r['model'][:32]:32s} {r['method']:6s} {r['batch']:5d} {r['off_tok_s']:10.1f} {r['spec_tok_s']:10.1f} "
              f"{r['speedup']:7.2f}x {r['acceptance']:7.3f} {r['mean_accepted_length']:8.2f} {r['auto_tok_s']:10.1f} "
              f"{r['auto_speedup']:6.2f}x")
    for method in methods:
        paying = [r["batch"] for r in rows if r["method"] == method and r["speedup"] >= 1.0]
        losing = [r["batch"] for r in rows if r["method"] == method and r["speedup"] < 1.0]
        off_above = max((b for b in paying if not losing or b < min(losing)), default=0)
        print(f"switch-off batch size {label} {method}: speculation pays up to {off_above} sequences"
              + (f" (slower from {min(losing)})" if losing else " (every batch measured)"))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
