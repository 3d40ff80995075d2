"""Benchmark Kiln's kernels on a CUDA device: achieved bandwidth against a measured D2D copy.

Usage (on the GPU machine, from the repository root)::

    python3 benchmarks/kernel_bench.py [--sweep] [--json out.json]

Method (docs/benchmarks.md, "Kernels"): every kernel time is the median over 7 replays of a
CUDA graph holding many back-to-back calls, divided by the number of calls, so host launch
overhead is excluded (the runtime replays decode as CUDA graphs).  Problems smaller than
256 MB are replicated and the calls rotate over the copies so that the 60 MB L2 cache does
not serve them.  Bytes are the least a kernel must move (each input read once, each output
written once); % is of the measured device-to-device copy bandwidth (4 GiB
``Tensor.copy_``, bytes read + written).  The host cost of one eager launcher call is
reported separately.  Headline: decode attention at batch 64, context 4096, 32 query /
8 KV heads, head dim 128, bf16 (issue 3: >= 80% of copy bandwidth).

``--sweep`` also times a grid of attention launch configurations and split counts, checks
each against the reference, and prints the best (copy it into the device's tuning table,
``kernels/kiln/kernels/tuning/<device>.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time

import torch
from triton.testing import do_bench

from kiln.kernels import (
    build_cos_sin_cache,
    fused_add_rms_norm,
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from kiln.kernels import tuning
from kiln.kernels.launch import decode_num_splits

GB = 1e9
L2_DEFEAT_BYTES = 256 << 20


def graph_time(fns, target_ms: float = 20.0) -> float:
    """Milliseconds per call of the closures ``fns`` (rotated), from CUDA-graph replays."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    est = do_bench(lambda: [f() for f in fns], warmup=5, rep=20, return_mode="median") / len(fns)
    rounds = max(1, min(200, int(target_ms / max(est, 1e-3) / len(fns))))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times) / (rounds * len(fns))


def host_us(fn, n: int = 300) -> float:
    """Host microseconds per eager call (GPU work is tiny; measured to the final sync)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def copies(nbytes: int) -> int:
    return max(1, min(8, math.ceil(L2_DEFEAT_BYTES / max(nbytes, 1))))


def copy_bandwidth(nbytes: int = 4 << 30) -> tuple[float, float]:
    """(ms, bytes/s) of a device-to-device copy of ``nbytes`` (read + write counted)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    return ms, 2 * nbytes / (ms * 1e-3)


def make_decode_problem(batch, ctx, Hq, Hkv, D, block_size, dtype, fp8=False, seed=0):
    """Random paged KV for ``batch`` sequences of ``ctx`` tokens, shuffled block ids."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = math.ceil(ctx / block_size)
    num_blocks = batch * nblk + 16
    store = torch.float8_e4m3fn if fp8 else dtype
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device="cuda", dtype=dtype, generator=g).to(store)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, device="cuda", dtype=dtype, generator=g).to(store)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * nblk]
    table = perm.view(batch, nblk).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Hq, D, device="cuda", dtype=dtype, generator=g)
    kv_bytes = 2 * batch * ctx * Hkv * D * k_cache.element_size()
    io_bytes = 2 * q.numel() * q.element_size() + table.numel() * 4
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, table=table, seq_lens=seq_lens, cu=cu), kv_bytes + io_bytes


def run_decode(p, scale, **kw):
    ks = vs = (0.05 if p["k_cache"].dtype == torch.float8_e4m3fn else None)
    return paged_attention(p["q"], p["k_cache"], p["v_cache"], p["table"], p["seq_lens"], p["cu"], scale, ks, vs,
                           max_query_len=1, **kw)


def decode_ref(p, scale):
    ks = vs = (0.05 if p["k_cache"].dtype == torch.float8_e4m3fn else None)
    return paged_attention_ref(p["q"].float(), p["k_cache"], p["v_cache"], p["table"], p["seq_lens"], p["cu"], scale, ks, vs)


def make_prefill_problem(q_lens, ctx_lens, Hq, Hkv, D, block_size, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblks = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(nblks) + 16
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    table = torch.zeros(len(ctx_lens), max(nblks), dtype=torch.int32, device="cuda")
    o = 0
    for i, n in enumerate(nblks):
        table[i, :n] = perm[o:o + n].to(torch.int32)
        o += n
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, device="cuda", dtype=dtype, generator=g)
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    # causal FLOPs: 2 matmuls x 2 flops x (visible keys summed over query rows) x heads x dim
    visible = sum(ql * (c - ql) + ql * (ql + 1) // 2 for ql, c in zip(q_lens, ctx_lens))
    flops = 4 * visible * Hq * D
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, table=table, seq_lens=seq_lens, cu=cu), flops


def run_prefill(p, scale, **kw):
    return paged_attention(p["q"], p["k_cache"], p["v_cache"], p["table"], p["seq_lens"], p["cu"], scale, **kw)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Table:
    def __init__(self, copy_bw):
        self.copy_bw = copy_bw
        self.rows = []

    def add(self, name, shape, ms, nbytes=None, flops=None, note="", host=None):
        row = {"kernel": name, "shape": shape, "us": ms * 1e3, "note": note}
        if nbytes:
            row["GBps"] = nbytes / (ms * 1e-3) / GB
            row["pct_copy"] = 100 * nbytes / (ms * 1e-3) / self.copy_bw
        if flops:
            row["TFLOPs"] = flops / (ms * 1e-3) / 1e12
        if host is not None:
            row["host_us"] = host
        self.rows.append(row)
        extra = (f"{row['GBps']:6.0f} GB/s {row['pct_copy']:5.1f}%" if nbytes else f"{row['TFLOPs']:6.1f} TFLOP/s")
        print(f"{name:22s} {shape:46s} {ms * 1e3:8.1f} us {extra} {note}", flush=True)

    def markdown(self):
        lines = ["| kernel | shape | time (us) | GB/s | % of copy BW | TFLOP/s | host us/call | note |",
                 "|---|---|---:|---:|---:|---:|---:|---|"]
        f = lambda r, k, fmt: (fmt.format(r[k]) if k in r else "")
        for r in self.rows:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['us']:.1f} | {f(r, 'GBps', '{:.0f}')} | "
                         f"{f(r, 'pct_copy', '{:.1f}')} | {f(r, 'TFLOPs', '{:.0f}')} | {f(r, 'host_us', '{:.0f}')} | {r['note']} |")
        return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time a grid of attention launch configs")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA device (it times CUDA graphs); nothing to do on the CPU")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sweep": {}}

    copy_ms, copy_bw = copy_bandwidth()
    results["copy_GBps"] = copy_bw / GB
    print(f"# {props.name}, {props.multi_processor_count} SMs; D2D copy 4 GiB: {copy_ms:.3f} ms -> "
          f"{copy_bw / GB:.0f} GB/s (read+write)", flush=True)
    tab = Table(copy_bw)
    Hq, Hkv, D = 32, 8, 128
    scale = D ** -0.5

    # ---- decode attention
    decode_shapes = [(64, 4096, 16, False), (64, 4096, 32, False), (64, 4096, 16, True), (1, 4096, 16, False),
                     (8, 8192, 16, False), (16, 1024, 16, False), (32, 2048, 16, False), (128, 2048, 16, False),
                     (256, 1024, 16, False)]
    for b, ctx, bs, fp8 in decode_shapes:
        p0, nbytes = make_decode_problem(b, ctx, Hq, Hkv, D, bs, torch.bfloat16, fp8=fp8)
        probs = [p0] + [make_decode_problem(b, ctx, Hq, Hkv, D, bs, torch.bfloat16, fp8=fp8, seed=i)[0]
                        for i in range(1, copies(nbytes))]
        label = f"B{b} ctx{ctx} Hq32 Hkv8 D128 {'fp8' if fp8 else 'bf16'} bs{bs}"
        ref = decode_ref(p0, scale)
        err = rel_err(run_decode(p0, scale), ref)
        headline = (b, ctx, bs, fp8) == (64, 4096, 16, False)
        if args.sweep and (headline or fp8 or b in (1, 8, 256)):
            cfgs = ([{"BLOCK_N": bn, "num_warps": nw, "num_stages": ns} for bn, nw, ns in
                     itertools.product([32, 64, 128], [4], [2, 3])] if headline or fp8 else [{}])
            if fp8:
                cfgs = cfgs + [dict(c, fp8_f16_dot=False) for c in cfgs]
            split_opts = [1, 2, 3, 4, 8] if not fp8 else [1, 2, 4]
            if b <= 8:
                split_opts = [4, 8, 16, 32]
            sweep, best = [], None
            for cfg, sp in itertools.product(cfgs, split_opts):
                try:
                    e = rel_err(run_decode(p0, scale, config=cfg, num_splits=sp), ref)
                    ms = graph_time([lambda p=p: run_decode(p, scale, config=cfg, num_splits=sp) for p in probs], 10.0)
                except Exception as ex:  # out of resources etc.
                    print(f"  {label} {cfg} splits={sp}: {type(ex).__name__}: {str(ex)[:80]}")
                    continue
                pct = 100 * nbytes / (ms * 1e-3) / copy_bw
                sweep.append({**cfg, "splits": sp, "us": ms * 1e3, "pct_copy": pct, "rel_err": e})
                print(f"  sweep {label} {cfg} splits={sp}: {ms * 1e3:7.1f} us {pct:5.1f}% err {e:.1e}", flush=True)
                if e < 2e-2 and (best is None or ms < best[0]):
                    best = (ms, cfg, sp)
            results["sweep"][label] = sweep
            print(f"# best for {label}: {best[1]} splits={best[2]} {best[0] * 1e3:.1f} us "
                  f"{100 * nbytes / (best[0] * 1e-3) / copy_bw:.1f}%", flush=True)
        ms = graph_time([lambda p=p: run_decode(p, scale) for p in probs])
        tab.add("decode_attention", label, ms, nbytes,
                note=f"splits={decode_num_splits(b, Hkv, p0['q'].device)} err={err:.1e} x{len(probs)} copies")
        if headline:
            results["decode_target_pct_copy"] = tab.rows[-1]["pct_copy"]
            results["decode_target_eager_us"] = do_bench(lambda: run_decode(p0, scale), warmup=50, rep=200,
                                                         return_mode="median") * 1e3
        del probs, p0, ref

    # ---- prefill attention (compute-bound: TFLOP/s)
    prefill_shapes = [([2048] * 4, [2048] * 4, "4x2048 prompts"),
                      ([512] * 8, [4096] * 8, "8x512 chunks after 3584 cached"),
                      ([8192], [8192], "1x8192 prompt"),
                      ([1] * 56 + [1024] * 2, [2048] * 56 + [1024, 3072], "mixed 56 decodes + 2x1024 chunks")]
    for ql, cl, label in prefill_shapes:
        p, flops = make_prefill_problem(ql, cl, Hq, Hkv, D, 16, torch.bfloat16)
        ref = paged_attention_ref(p["q"].float(), p["k_cache"], p["v_cache"], p["table"], p["seq_lens"], p["cu"], scale)
        err = rel_err(run_prefill(p, scale), ref)
        if args.sweep:
            for cfg in [{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
                        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
                        {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
                        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}]:
                ms = graph_time([lambda: run_prefill(p, scale, config=cfg)], 10.0)
                e = rel_err(run_prefill(p, scale, config=cfg), ref)
                print(f"  sweep {label} {cfg}: {ms * 1e3:8.1f} us {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s err {e:.1e}")
        ms = graph_time([lambda: run_prefill(p, scale)])
        tab.add("prefill_attention", f"{label} Hq32 Hkv8 D128 bf16", ms, flops=flops, note=f"err={err:.1e}")
        del p, ref

    # ---- the memory-bound helpers at Llama-3-8B sizes (8192 tokens), rotated over 4 copies
    T, H, inter = 8192, 4096, 14336
    xs = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    rs = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty_like(x) for x in xs]
    nb = 2 * T * H * 2
    tab.add("rms_norm", f"T{T} H{H} bf16", graph_time([lambda x=x, o=o: rms_norm(x, w, 1e-5, out=o) for x, o in zip(xs, outs)]),
            nb)
    tab.add("torch rms_norm (peer)", f"T{T} H{H} bf16 eager",
            graph_time([lambda x=x: torch.nn.functional.rms_norm(x, (H,), w, 1e-5) for x in xs]), nb)
    tab.add("fused_add_rms_norm", f"T{T} H{H} bf16 in place",
            graph_time([lambda x=x, r=r: fused_add_rms_norm(x, r, w, 1e-5, inplace=True) for x, r in zip(xs, rs)]), 2 * nb)
    del xs, rs, outs
    gs = [torch.randn(T, 2 * inter, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    nb = T * 2 * inter * 2 * 3 // 2
    tab.add("silu_and_mul", f"T{T} I{inter} bf16", graph_time([lambda g=g: silu_and_mul(g) for g in gs]), nb)
    tab.add("torch silu*mul (peer)", f"T{T} I{inter} bf16 eager",
            graph_time([lambda g=g: torch.nn.functional.silu(g[:, :inter]) * g[:, inter:] for g in gs]), nb)
    del gs
    cs = build_cos_sin_cache(D, 131072, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}).cuda()
    pos = torch.randint(0, 131072, (T,), device="cuda")
    qs = [torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    ks = [torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    tab.add("rotary_embedding", f"T{T} Hq32 Hkv8 D128 bf16 in place",
            graph_time([lambda q=q, k=k: rotary_embedding(pos, q, k, cs) for q, k in zip(qs, ks)]),
            2 * (qs[0].numel() + ks[0].numel()) * 2 + T * D * 4)
    vs = [torch.randn_like(k) for k in ks]
    nblk = T // 16 + 64
    kc = torch.empty(4 * nblk, 16, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    slots = [torch.randperm(nblk * 16, device="cuda")[:T] + i * nblk * 16 for i in range(4)]
    tab.add("reshape_and_cache", f"T{T} Hkv8 D128 bf16",
            graph_time([lambda k=k, v=v, s=s: reshape_and_cache(k, v, kc, vc, s) for k, v, s in zip(ks, vs, slots)]),
            2 * 2 * ks[0].numel() * 2 + T * 8)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    tab.add("reshape_and_cache", f"T{T} Hkv8 D128 bf16->fp8 per-tensor",
            graph_time([lambda k=k, v=v, s=s: reshape_and_cache(k, v, kc8, vc8, s, 0.1, 0.1) for k, v, s in zip(ks, vs, slots)]),
            2 * ks[0].numel() * (2 + 1) + T * 8)

    # ---- host cost of one eager launcher call (tiny inputs: the GPU work is negligible)
    host = {}
    tp, _ = make_decode_problem(4, 64, Hq, Hkv, D, 16, torch.bfloat16)
    host["paged_attention decode (4 splits)"] = host_us(lambda: run_decode(tp, scale, num_splits=4))
    host["paged_attention decode (1 split)"] = host_us(lambda: run_decode(tp, scale, num_splits=1))
    pp, _ = make_prefill_problem([16, 16], [32, 16], Hq, Hkv, D, 16, torch.bfloat16)
    host["paged_attention prefill"] = host_us(lambda: run_prefill(pp, scale))
    x, r = torch.randn(4, H, device="cuda", dtype=torch.bfloat16), torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    host["rms_norm"] = host_us(lambda: rms_norm(x, w, 1e-5))
    host["fused_add_rms_norm (in place)"] = host_us(lambda: fused_add_rms_norm(x, r, w, 1e-5, inplace=True))
    xr = torch.cat([x, r], 1)
    host["silu_and_mul"] = host_us(lambda: silu_and_mul(xr))
    host["rotary_embedding"] = host_us(lambda: rotary_embedding(pos[:4], qs[0][:4], ks[0][:4], cs))
    host["reshape_and_cache"] = host_us(lambda: reshape_and_cache(ks[0][:4], vs[0][:4], kc, vc, slots[0][:4]))
    host["torch.add (floor, no Triton)"] = host_us(lambda: torch.add(x, r))
    results["host_us_per_call"] = host
    print("\n# host microseconds per eager call (tiny inputs)")
    for k_, v_ in host.items():
        print(f"#   {k_:40s} {v_:6.1f} us")

    results["rows"] = tab.rows
    print(f"\n# decode headline eager (do_bench, launch overhead included): {results['decode_target_eager_us']:.1f} us")
    print(tab.markdown())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
