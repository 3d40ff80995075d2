"""Sweep, check and time the small-M GEMV (``kiln.kernels.gemv``) against cuBLAS on an H200.

Usage (GPU machine, repository root)::

    python3 benchmarks/gemv_bench.py [--json OUT] [--budget-s 150]

Shapes: Llama-3.1-8B's qkv, o, gate_up, down and LM head, M = 1, 2, 4, 8, bf16.  Method: every
time is per call inside one CUDA graph whose calls cycle through enough copies of the weight
(>= 256 MB) that the 60 MB L2 serves none of them; cuBLAS is ``F.linear`` (what the linear
layers run; for the LM head ``F.linear(...).float()``, as ``compute_logits`` does, against the
kernel writing float32 directly).  All configs of ``space(M)`` x split-K are compiled first in
worker processes, then timed per shape and M; the winner is checked against a float32
reference and re-timed with more calls, next to cuBLAS.  The last line is the ``TUNED`` table
(entries only where the kernel won).  Past ``--budget-s`` the sweep keeps only the default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
MS = (1, 2, 4, 8)
L2_DEFEAT_BYTES = 256 << 20
DEVICE = "cuda"


def space(M: int) -> list[dict]:
    """Configs swept for one M bucket (without SPLIT_K): BLOCK_K = 256 * warps * r (no layout
    conversion), accumulator <= 16 x 8 floats per thread."""
    out = []
    for warps in (2, 4, 8):
        for r in (1, 2):
            for bn in (1, 2, 4, 8, 16):
                if M * bn * r > 16 or (M == 1 and bn == 1):
                    continue
                for st in (1, 2):
                    out.append({"BLOCK_M": M, "BLOCK_N": bn, "BLOCK_K": 256 * warps * r, "num_warps": warps,
                                "num_stages": st})
    return out


def splits_for(N: int) -> tuple[int, ...]:
    return (1, 2, 4) if N <= 8192 else (1,)


def _warm(jobs) -> int:
    """Compile in a worker process (fills Triton's cache): one call per (M, K, config, out dtype)."""
    from kiln.kernels.gemv import gemv

    ok = 0
    for M, K, cfg, out_dtype in jobs:
        try:
            w = torch.zeros(4096, K, device=DEVICE, dtype=torch.bfloat16)
            gemv(torch.zeros(M, K, device=DEVICE, dtype=torch.bfloat16), w, out_dtype, cfg)
            ok += 1
        except Exception:  # noqa: BLE001 - out of resources: the sweep skips it
            pass
    torch.cuda.synchronize()
    return ok


def graph_time(fns, min_calls: int = 16, reps: int = 3) -> float:
    """Seconds per call of the closures ``fns`` (cycled, at least ``min_calls`` calls) replayed
    from one CUDA graph; median of ``reps`` replays."""
    calls = fns * max(1, -(-min_calls // len(fns)))
    for f in fns:
        f()  # eager first: lazily allocated state (split-K counters) exists before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    del g
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget-s", type=float, default=110.0, help="stop sweeping (default config only) after this")
    ap.add_argument("--procs", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args(argv)
    import multiprocessing as mp

    from kiln.kernels.gemv import TUNED, choose_config, gemv

    t_start = time.perf_counter()
    TUNED.clear()  # sweep from the defaults; the table printed at the end replaces it
    jobs = []  # the compiled variant depends on M == 1 or not, the config, split or not, K % BLOCK_K
    for M in MS:
        for cfg in space(M):
            for K in sorted({K for _, K in SHAPES.values() if K % cfg["BLOCK_K"]} | {4096}):
                jobs += [(M, K, dict(cfg, SPLIT_K=sp), torch.bfloat16) for sp in (1, 2)]
            jobs.append((M, 4096, dict(cfg, SPLIT_K=1), torch.float32))
    jobs = jobs[::-1]  # the biggest tiles (slowest compiles) first
    with mp.get_context("spawn").Pool(a.procs) as pool:
        ok = sum(pool.map(_warm, [jobs[i::a.procs] for i in range(a.procs)]))
    print(json.dumps({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
                      "compile_s": round(time.perf_counter() - t_start, 1), "jobs": len(jobs), "ok": ok}), flush=True)
    rows, tuned = [], {}
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        lm = name == "lm_head"
        out_dtype = torch.float32 if lm else None
        nbytes = N * K * 2
        g = torch.Generator(device=DEVICE).manual_seed(0)
        ws = [torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16, generator=g) * 0.02
              for _ in range(max(2, -(-L2_DEFEAT_BYTES // nbytes)))]
        for M in MS:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
            if lm:
                base_fns = [lambda w=w: F.linear(x, w).float() for w in ws]
            else:
                base_fns = [lambda w=w: F.linear(x, w) for w in ws]

            def fns(cfg):
                return [lambda w=w: gemv(x, w, out_dtype, cfg) for w in ws]

            default = choose_config(M, N, K, x.device)
            cands = [default]
            if time.perf_counter() - t_start < a.budget_s:
                cands += [dict(c, SPLIT_K=sp) for c in space(M) for sp in (splits_for(N) if not lm else (1,))]
            best, n_ok = None, 0
            for cfg in cands:
                try:
                    t = graph_time(fns(cfg))
                except Exception:  # noqa: BLE001 - resources exceeded etc.
                    continue
                n_ok += 1
                if best is None or t < best[0]:
                    best = (t, cfg)
            cfg = best[1]
            ref = F.linear(x.float(), ws[0].float())
            errs = []
            for _ in range(3):  # repeated: the split-K counters must come back to zero
                y = gemv(x, ws[0], out_dtype, cfg).float()
                errs.append(float((y - ref).norm() / ref.norm()))
            t_cublas = graph_time(base_fns, min_calls=64, reps=5)
            t_gemv = graph_time(fns(cfg), min_calls=64, reps=5)
            t_default = graph_time(fns(default), min_calls=64, reps=5)
            row = {"shape": name, "N": N, "K": K, "M": M, "cublas_us": round(t_cublas * 1e6, 2),
                   "gemv_us": round(t_gemv * 1e6, 2), "speedup": round(t_cublas / t_gemv, 3),
                   "cublas_TBps": round(nbytes / t_cublas / 1e12, 3), "gemv_TBps": round(nbytes / t_gemv / 1e12, 3),
                   "default_us": round(t_default * 1e6, 2), "max_rel_err": max(errs), "configs_timed": n_ok,
                   "config": cfg, "t_s": round(time.perf_counter() - t_start, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if t_gemv < t_cublas and max(errs) < 1e-2:
                tuned[(N, K, M)] = cfg
        del ws
        torch.cuda.empty_cache()
    print("| shape (N x K) | M | cuBLAS us | GEMV us | speedup | cuBLAS TB/s | GEMV TB/s | config (BMxBNxBK, warps, stages, split) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["config"]
        print(f"| {r['shape']} {r['N']} x {r['K']} | {r['M']} | {r['cublas_us']:.1f} | {r['gemv_us']:.1f} | "
              f"{r['speedup']:.2f}x | {r['cublas_TBps']:.2f} | {r['gemv_TBps']:.2f} | "
              f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}, {c['num_warps']}, {c['num_stages']}, {c['SPLIT_K']} |")
    print("TUNED = {")
    for (N, K, M), c in tuned.items():
        print(f"    ({N}, {K}, {M}): {json.dumps(c)},")
    print("}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "tuned": [[*k, v] for k, v in tuned.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
