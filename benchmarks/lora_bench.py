"""Multi-LoRA serving cost: offline throughput of the Llama-3.1-8B shape (random weights) with
4 rank-16 adapters mixed uniformly over the requests, against the same run without LoRA.

Usage (repository root, on the GPU machine)::

    PYTHONPATH=common:runtime:kernels python3 benchmarks/lora_bench.py
        [--num-prompts 1000 --input-len 1000 --output-len 1000] [--model builtin:llama-3.1-8b]
        [--num-adapters 4 --rank 16 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]
        [--modes base,lora] [--json out.json]

On the CPU (a check that it runs; numbers mean nothing): ``--model FOLDER`` with a small
``config.json`` and ``--num-prompts 4 --input-len 16 --output-len 8``.

Each mode runs in its own process (one engine per GPU at a time): ``base`` (no LoRA),
``lora`` (``enable_lora``, ``max_loras`` = adapters, request i uses adapter i mod N) and
``lora-idle`` (LoRA on, every request on the base: the cost of the wrapped linears alone).
Adapters are the builtin random ones (``builtin:random?rank=R&seed=k&targets=...``, PEFT folders
written by ``kiln.runtime.lora.builtin`` for the model's shapes, as ``kiln adapter fetch`` writes
them); no peft needed.  Prints tokens/s per mode and the relative cost.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(ns: argparse.Namespace, root: Path) -> dict[str, str]:
    """The builtin random adapters ``a0..a{N-1}`` (seed k) for ``ns.model``'s shapes (its
    config; no weights read): ``{name: folder}``."""
    from kiln.common.adapterref import BuiltinAdapter
    from kiln.runtime import loader
    from kiln.runtime.lora.builtin import write_builtin_adapter

    cfg = loader.load_model_config(loader.resolve_source(ns.model))
    out = {}
    for k in range(ns.num_adapters):
        ref = BuiltinAdapter.from_string(f"builtin:random?rank={ns.rank}&seed={k}&targets={ns.targets}")
        out[f"a{k}"] = str(write_builtin_adapter(root / f"a{k}", ref, cfg))
    return out


def run_mode(ns: argparse.Namespace) -> dict:
    import torch

    from kiln.runtime import LLM, LoRARequest, SamplingParams

    t_start = time.perf_counter()
    lora = ns.mode in ("lora", "lora-idle")
    adapters = write_adapters(ns, Path(tempfile.mkdtemp(prefix="kiln-lora-bench-"))) if lora else {}
    extra = dict(lora_modules=adapters, max_loras=max(ns.num_adapters, 1), max_lora_rank=ns.rank) if lora else {}
    llm = LLM(model=ns.model, load_format="dummy", max_num_seqs=ns.max_num_seqs,
              max_model_len=ns.input_len + ns.output_len + 16, **extra)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, max(101, min(120000, vocab - 1)), (ns.input_len,), generator=g).tolist()
               for _ in range(ns.num_prompts)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True, detokenize=False)
    names = list(adapters)
    reqs = [LoRARequest(names[i % len(names)]) if ns.mode == "lora" else None for i in range(ns.num_prompts)]
    llm.generate(prompts[:4], sp if ns.output_len <= 8 else SamplingParams(temperature=0.0, max_tokens=8,
                                                                          ignore_eos=True, detokenize=False),
                 lora_request=reqs[:4])  # warm: first-touch of every path
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=reqs)
    sync()
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"mode": ns.mode, "seconds": dt, "output_tokens_per_s": gen / dt,
            "total_tokens_per_s": (gen + ns.num_prompts * ns.input_len) / dt, "requests_per_s": ns.num_prompts / dt,
            "num_adapters": ns.num_adapters if lora else 0, "rank": ns.rank if lora else 0,
            "startup_seconds": t0 - t_start,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--model", default="builtin:llama-3.1-8b",
                    help="a model whose shape is served with random weights (--load-format dummy)")
    ap.add_argument("--modes", default="base,lora", help="comma list of base, lora, lora-idle")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # one mode, in this process
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    if ns.mode:
        print("RESULT " + json.dumps(run_mode(ns)), flush=True)
        return
    results = []
    t_all = time.perf_counter()
    for mode in ns.modes.split(","):
        args = [a for a in (argv if argv is not None else sys.argv[1:])]
        p = subprocess.run([sys.executable, __file__, *args, "--mode", mode], capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode or line is None:
            print(f"{mode}: failed (rc {p.returncode})\n{p.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append(json.loads(line[7:]))
        r = results[-1]
        print(f"{mode:10s} {r['output_tokens_per_s']:10.1f} out tok/s  {r['total_tokens_per_s']:10.1f} total tok/s  "
              f"{r['seconds']:.1f} s (+{r['startup_seconds']:.1f} s start-up) on {r['gpu']}", flush=True)
    base = next((r for r in results if r["mode"] == "base"), None)
    for r in results:
        if base is not None and r is not base:
            cost = 1 - r["output_tokens_per_s"] / base["output_tokens_per_s"]
            r["throughput_cost_vs_base"] = cost
            print(f"{r['mode']}: throughput cost vs base {100 * cost:.1f}%")
    print(f"wall {time.perf_counter() - t_all:.1f} s for {ns.modes}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
