"""Where an offline workload's time goes, per step type, against each step's own bound (GPU).

Runs workloads through ``LLM.generate`` (the ``kiln bench offline`` path: random weights of
the model's shape, quantized at load) with a hook on the scheduler that records every step's
composition, and times each step as the host sees it (with asynchronous scheduling the host
plans step N+1 while N runs and then waits for N, so the gap between two plans is the GPU's
step time in steady state).  Each step gets a bound from its composition:

- GEMMs: ``2 x tokens x (layer weights)`` plus ``2 x sampled rows x (LM head)`` FLOPs over
  ``--gemm-tflops`` (the FP8 ``torch._scaled_mm`` rate with activation quantization);
- decode attention: each decode row reads its whole context's K and V (bytes per token from
  the KV dtype) at the copy bandwidth measured here;
- prefill attention: ``4 x heads x head_dim x layers`` FLOPs per (query, key) pair of each
  causal chunk, over ``--attn-tflops``.

Steps are grouped as decode-only, mixed (decodes and prefill chunks) and prefill-only, and
one torch-profiler window of ``--window`` steps per type gives the kernel time by category
(GEMM, activation quantization, attention, norms, rotary + KV write, SiLU, sampling and the
rest), so each category can be set against its part of the bound.

    python3 benchmarks/step_profile.py --quantization fp8 --kv-cache-dtype fp8 \\
        --workloads 1000x1000/1000@768,4096x128/128@512,1000x2048/128@256 [--json FILE]

``N x IN/OUT@SEQS``: N requests of IN prompt and OUT output tokens (EOS ignored), all queued at
once, at most SEQS running (the engine is built for the largest SEQS; each workload lowers
the scheduler's limit).  Not a test: prints numbers (``$OUT/step_profile.json`` when ``OUT``
is set).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

CATEGORIES = (  # (category, kernel-name pattern), the first match wins
    ("quant", r"per_token_quant_fp8"),
    ("attention", r"paged_attn|merge_splits"),
    ("norm", r"rms_norm"),
    ("rotary+kv", r"rotary|reshape_and_cache"),
    ("silu", r"silu"),
    ("gemv", r"gemv"),
    ("gemm", r"gemm|nvjet|cutlass|sm90_|xmma|splitk|scaled_mm|cublas"),
    ("memcpy", r"memcpy|memset"),
    ("other", r"."),
)


def parse_workloads(text: str) -> list[tuple[int, int, int, int]]:
    """``N x IN/OUT@SEQS,...`` as ``[(n, input_len, output_len, max_num_seqs)]`` (ValueError)."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)/(\d+)@(\d+)\s*", part)
        if not m:
            raise ValueError(f"workload {part!r}: expected N x IN/OUT@SEQS, e.g. 1000x1000/1000@768")
        out.append(tuple(int(g) for g in m.groups()))
    return out


def copy_bandwidth() -> float:
    """Device-to-device copy rate, read + write bytes per second (1 GiB buffers)."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(20):
        b.copy_(a)
    t1.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * 20 / (t0.elapsed_time(t1) / 1e3)


class StepModel:
    """The bound of one step from its composition (seconds)."""

    def __init__(self, cfg, kv_elem: int, gemm: float, attn: float, copy: float):
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
        self.layer_weights = layer * cfg.num_hidden_layers
        self.head_weights = cfg.vocab_size * h
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv * kv_elem
        self.pair_flop = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
        self.gemm, self.attn, self.copy = gemm, attn, copy

    def bound(self, row: dict) -> tuple[float, float, float]:
        """(GEMM s, decode attention s, prefill attention s) of a step record."""
        flop = 2 * (row["tokens"] * self.layer_weights + row["sampled"] * self.head_weights)
        return (flop / self.gemm, row["decode_ctx"] * self.kv_bytes_per_token / self.copy,
                row["prefill_pairs"] * self.pair_flop / self.attn)


def categorize(key_averages, steps: int) -> tuple[dict, list]:
    """Kernel time per category (ms per step, launches per step) and the top kernels."""
    cats: dict = {}
    rows = [e for e in key_averages if e.self_device_time_total > 0]
    for e in rows:
        name = e.key.lower()
        cat = next(c for c, pat in CATEGORIES if re.search(pat, name))
        ms, n = cats.get(cat, (0.0, 0.0))
        cats[cat] = (ms + e.self_device_time_total / 1e3 / steps, n + e.count / steps)
    top = sorted(rows, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    return ({c: (round(ms, 3), round(n, 1)) for c, (ms, n) in sorted(cats.items(), key=lambda kv: -kv[1][0])},
            [(e.key[:70], round(e.count / steps, 1), round(e.self_device_time_total / 1e3 / steps, 3)) for e in top])


def step_kind(row: dict) -> str:
    if row["prefill_tokens"] == 0:
        return "decode"
    return "mixed" if row["decode_rows"] else "prefill"


def run_workload(llm, model: StepModel, n: int, il: int, ol: int, seqs: int, window: int,
                 host_profile: bool = False) -> dict:
    """One workload with the per-step log and a profiler window per step type; with
    ``host_profile`` no kernel windows but a cProfile of the host side (top functions by own
    time, printed)."""
    from torch.profiler import ProfilerActivity, profile

    from kiln.runtime.bench_common import make_workload
    from kiln.runtime.sampling_params import SamplingParams

    eng = llm.engine
    cuda = eng.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # the CPU runs only smoke-test this script
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    eng.scheduler.config.max_num_seqs = seqs
    wl = make_workload(n, il, ol, 0.0, eng.model_config.vocab_size, seed=0)
    llm.generate([wl.prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                      detokenize=False))
    for p, o in zip(wl.prompts, wl.output_lens):
        eng.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False))
    sched = eng.scheduler
    plan = sched.schedule
    log: list[dict] = []
    preempted0 = sched.num_preemptions_total

    def logged():
        out = plan()
        row = {"t": time.perf_counter(), "decode_rows": 0, "prefill_tokens": 0, "tokens": 0, "sampled": 0,
               "decode_ctx": 0, "prefill_pairs": 0, "seqs": len(out.scheduled)}
        for sr in out.scheduled:
            c, k = sr.num_computed_tokens, sr.num_new_tokens
            row["tokens"] += k
            row["sampled"] += sr.needs_sample
            if sr.is_decode:
                row["decode_rows"] += 1
                row["decode_ctx"] += c + k
            else:
                row["prefill_tokens"] += k
                row["prefill_pairs"] += k * c + k * (k + 1) // 2
        log.append(row)
        return out

    sched.schedule = logged
    windows: dict = {}
    prof, prof_kind, prof_start = None, None, 0
    sync()
    if host_profile:
        import cProfile  # noqa: PLC0415
        import pstats  # noqa: PLC0415

        window = 0
        cpr = cProfile.Profile()
        cpr.enable()
    t0 = time.perf_counter()
    try:
        while eng.has_unfinished_requests():
            if prof is None and log:
                kind = step_kind(log[-1])
                full = kind != "decode" or log[-1]["seqs"] >= 0.9 * min(seqs, n)
                if window and kind not in windows and full and len(log) > 8:
                    prof, prof_kind, prof_start = profile(activities=[activity]), kind, len(log)
                    prof.__enter__()
            eng.step()
            if prof is not None and len(log) - prof_start >= window:
                sync()
                prof.__exit__(None, None, None)
                steps = len(log) - prof_start
                rows = log[prof_start:len(log)]
                cats, top = categorize(prof.key_averages(), steps)
                b = [sum(x) / steps * 1e3 for x in zip(*(model.bound(r) for r in rows))]
                windows[prof_kind] = {"at_step": prof_start, "steps": steps,
                                      "seqs": sum(r["seqs"] for r in rows) / steps,
                                      "prefill_tokens": sum(r["prefill_tokens"] for r in rows) / steps,
                                      "bound_ms": {"gemm": b[0], "decode_attention": b[1], "prefill_attention": b[2]},
                                      "kernels_ms": cats, "top": top,
                                      "gpu_ms": sum(v[0] for v in cats.values())}
                prof = None
    finally:
        sched.schedule = plan
        if prof is not None:
            prof.__exit__(None, None, None)
        if host_profile:
            cpr.disable()
            pstats.Stats(cpr).sort_stats("tottime").print_stats(40)
    sync()
    wall = time.perf_counter() - t0
    skip = {i for w in windows.values() for i in range(w["at_step"] - 1, w["at_step"] + w["steps"] + 1)}
    kinds: dict = {}
    for i, row in enumerate(log[:-1]):
        if i in skip:
            continue
        k = kinds.setdefault(step_kind(row), {"steps": 0, "s": 0.0, "gemm_s": 0.0, "decode_attn_s": 0.0,
                                                "prefill_attn_s": 0.0, "tokens": 0, "seqs": 0})
        dt = log[i + 1]["t"] - row["t"]
        g, d, p = model.bound(row)
        k["steps"] += 1
        k["s"] += dt
        k["gemm_s"] += g
        k["decode_attn_s"] += d
        k["prefill_attn_s"] += p
        k["tokens"] += row["tokens"]
        k["seqs"] += row["seqs"]
    for k in kinds.values():
        k["bound_s"] = k["gemm_s"] + k["decode_attn_s"] + k["prefill_attn_s"]
        k["of_bound"] = k["bound_s"] / k["s"] if k["s"] else 0.0
        k["ms_per_step"] = k["s"] / k["steps"] * 1e3
        k["mean_seqs"] = k["seqs"] / k["steps"]
    return {"workload": f"{n}x{il}/{ol}", "max_num_seqs": seqs, "wall_s": wall, "output_tok_s": n * ol / wall,
            "steps": len(log), "preemptions": sched.num_preemptions_total - preempted0, "kinds": kinds, "windows": windows,
            "step_log": [(step_kind(r)[0], r["seqs"], r["tokens"], round((log[i + 1]["t"] - r["t"]) * 1e3, 3),
                          round(sum(model.bound(r)) * 1e3, 3)) for i, r in enumerate(log[:-1])]}


def report(r: dict) -> None:
    print(f"\n== {r['workload']} at {r['max_num_seqs']} seqs: {r['output_tok_s']:,.0f} tok/s, {r['wall_s']:.1f} s, "
          f"{r['steps']} steps, {r['preemptions']} preemptions")
    print(f"{'step type':10s} {'steps':>6s} {'seqs':>6s} {'s':>7s} {'ms/step':>8s} {'bound s':>8s} {'GEMM':>7s} "
          f"{'dec attn':>8s} {'pf attn':>8s} {'of bound':>8s}")
    for kind, k in r["kinds"].items():
        print(f"{kind:10s} {k['steps']:6d} {k['mean_seqs']:6.0f} {k['s']:7.2f} {k['ms_per_step']:8.2f} "
              f"{k['bound_s']:8.2f} {k['gemm_s']:7.2f} {k['decode_attn_s']:8.2f} {k['prefill_attn_s']:8.2f} "
              f"{k['of_bound']:8.1%}")
    for kind, w in r["windows"].items():
        b = w["bound_ms"]
        print(f"  [{kind} window] {w['steps']} steps from step {w['at_step']}, {w['seqs']:.0f} seqs, "
              f"{w['prefill_tokens']:.0f} prefill tokens/step; GPU {w['gpu_ms']:.2f} ms/step; bound GEMM "
              f"{b['gemm']:.2f}, decode attention {b['decode_attention']:.2f}, prefill attention "
              f"{b['prefill_attention']:.2f} ms/step")
        print("    by category (ms/step, launches/step): " + ", ".join(f"{c} {ms:.2f} ({n:.0f})" for c, (ms, n)
                                                                      in w["kernels_ms"].items()))
        for name, cnt, ms in w["top"][:8]:
            print(f"      {ms:8.3f} ms  x{cnt:<5} {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:llama-3.1-8b")
    ap.add_argument("--quantization", default="fp8")
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"])
    ap.add_argument("--workloads", default="1000x1000/1000@768,4096x128/128@512,1000x2048/128@256")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--kv-fraction", type=float, default=0.94)
    ap.add_argument("--window", type=int, default=8, help="steps per profiler window")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile the host side of each run instead of the kernel windows")
    ap.add_argument("--gemm-tflops", type=float, default=1150.0)
    ap.add_argument("--attn-tflops", type=float, default=227.0)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    workloads = parse_workloads(ns.workloads)
    from kiln.runtime import LLM

    copy = copy_bandwidth()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy {copy / 1e12:.2f} TB/s", flush=True)
    t0 = time.perf_counter()
    llm = LLM(model=ns.model, load_format="dummy", dtype="bfloat16", quantization=ns.quantization,
              kv_cache_dtype=ns.kv_cache_dtype, max_num_seqs=max(w[3] for w in workloads),
              max_num_batched_tokens=ns.max_num_batched_tokens, max_model_len=4096,
              kv_cache_memory_fraction=ns.kv_fraction)
    runner = llm.engine.runner
    kv_elem = torch.tensor([], dtype=runner.kv_cache_dtype()).element_size()
    print(f"loaded in {time.perf_counter() - t0:.0f} s: {runner.num_kv_blocks} KV blocks of {llm.engine.args.block_size} "
          f"({runner.kv_cache_dtype()}), weights {ns.quantization}, budget {ns.max_num_batched_tokens}", flush=True)
    model = StepModel(llm.engine.model_config, kv_elem, ns.gemm_tflops * 1e12, ns.attn_tflops * 1e12, copy)
    results = []
    for n, il, ol, seqs in workloads:
        results.append(run_workload(llm, model, n, il, ol, seqs, ns.window, ns.host_profile))
        report(results[-1])
    path = ns.json or (os.path.join(os.environ["OUT"], "step_profile.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"args": vars(ns), "copy_Bps": copy, "device": torch.cuda.get_device_name(),
                       "results": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
