"""Batch-1 decode of the Llama-3.1-8B shape (random weights) with a per-step breakdown
(device only): host time of ``LLMEngine.step``, of the launch (``execute_async``) and of the
wait for the sampled ids, and, from CUDA events recorded around each step's launches, the GPU
span of a step and the GPU idle gap between steps (0 when asynchronous scheduling keeps the
GPU fed).  Medians over the last 200 of 256 steps, one JSON line.

    python3 benchmarks/decode_steps.py {bf16|int4|fp8|int4-lmhead|...}[-nopdl][-unfused] [--profile]

``--profile`` adds, on a second line, the kernels of most GPU time per step (torch profiler over
64 more steps).

The method names are those of ``benchmarks/gpu_bench.py``'s ``bench_decode`` (which this wraps);
run each method in a fresh process.  The ``-nopdl`` and ``-unfused`` suffixes (``EngineArgs.pdl``,
``EngineArgs.fused_rope_kv``) give the A/B runs of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import kiln.runtime.engine as en
import kiln.runtime.model_runner as mr
import gpu_bench as g  # benchmarks/gpu_bench.py (this script's folder is on sys.path)


def main(method: str, profile: bool = False) -> dict:
    rec: dict[str, list] = {"wait": [], "exec": [], "step": [], "ev": []}
    on = [True]  # off during the profiled steps, which are not part of the medians
    o_res, o_ex, o_step = mr.PendingStep.result, mr.ModelRunner.execute_async, en.LLMEngine.step

    def result(self):
        t = time.perf_counter()
        r = o_res(self)
        if on[0]:
            rec["wait"].append(time.perf_counter() - t)
        return r

    def execute_async(self, out, rows, *args, **kwargs):
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter()
        r = o_ex(self, out, rows, *args, **kwargs)
        if on[0]:
            rec["exec"].append(time.perf_counter() - t)
        e1 = torch.cuda.Event(enable_timing=True)
        e1.record()
        if on[0]:
            rec["ev"].append((e0, e1))
        return r

    def step(self):
        t = time.perf_counter()
        r = o_step(self)
        if on[0]:
            rec["step"].append(time.perf_counter() - t)
        return r

    o_prof = g._profile_decode

    def profiled(*a):
        on[0] = False
        try:
            return o_prof(*a)
        finally:
            on[0] = True

    mr.PendingStep.result, mr.ModelRunner.execute_async, en.LLMEngine.step = result, execute_async, step
    g._profile_decode = profiled
    try:
        rows = g.bench_decode((method,), new_tokens=256, profile_tokens=64 if profile else 0)
    finally:
        mr.PendingStep.result, mr.ModelRunner.execute_async, en.LLMEngine.step = o_res, o_ex, o_step
        g._profile_decode = o_prof
    torch.cuda.synchronize()
    n = 200
    ev = rec["ev"][-n:]
    span = [a.elapsed_time(b) for a, b in ev]
    gap = [ev[i][1].elapsed_time(ev[i + 1][0]) for i in range(len(ev) - 1)]

    def med(v):
        return sorted(v)[len(v) // 2]

    out = {"method": method, "ms_per_token": rows[0]["ms_per_token"], "load_s": rows[0]["load_s"],
           "step_host_ms": 1e3 * med(rec["step"][-n:]), "exec_host_ms": 1e3 * med(rec["exec"][-n:]),
           "wait_ms": 1e3 * med(rec["wait"][-n:]), "gpu_span_ms": med(span), "gpu_gap_ms": med(gap)}
    if profile:
        print(json.dumps({"method": method, "profile_gpu_us": rows[0]["profile_gpu_us"],
                          "profile": rows[0]["profile"]}), flush=True)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--profile"]
    main(args[0] if args else "int4", profile="--profile" in sys.argv[1:])
