"""GPU measurements of the quantized paths (H200, Llama-3.1-8B shapes, random weights).

``python3 benchmarks/gpu_bench.py [--skip-decode] [--decode-batch B] --json OUT``
``python3 benchmarks/gpu_bench.py --only w4a16-variants [--decode-methods bf16,int4,int4-nopdl
--only w4a16-variants,decode] --json OUT``

A lab tool (not installed with Kiln): it measures the product through its public APIs and steers
it only through ``KernelOptions`` / ``EngineArgs`` and explicit launch configs.

0. (``w4a16-variants``) The GEMV kernels side by side at M = 1, 2, 4: the float32 ``gemv``
   (its ``TUNED`` config or default), the packed-half ``gemv2`` (a small sweep, best shown)
   and bf16 cuBLAS, same graphs and weight copies as part 1; about a minute on an H200.

1. W4A16 GEMM (``kiln.kernels.w4a16``) vs bf16 cuBLAS (``x @ W.T``) at M = 1, 2, 4, 8, 16 on
   the 8B projection shapes: a launch-config sweep per shape and M (compiled first in worker
   processes; prints the winners as a tuning table's ``"w4a16"`` entries), a check of the winner against the
   reference, then both timed inside one CUDA graph that cycles through enough weight copies
   (>= 512 MB) that nothing is served from the 60 MB L2; time per GEMM.
2. FP8 GEMM (``torch._scaled_mm`` rowwise) vs bf16 at M >= 1024, alone and with the dynamic
   per-token activation quantization (what ``Fp8LinearMethod.apply`` runs).
3. Batch-1 decode of the whole 8B model (``builtin:llama-3.1-8b``, dummy weights, CUDA
   graphs) in bf16, int4 (RTN of the dummy weights in AWQ's format: same kernel and bytes)
   and fp8: output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kiln.kernels.options import KernelOptions

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# + the LM head (vocabulary 128256), quantized by ``kiln build --quantize-lm-head``; its GEMM
# writes float32 logits (``out_dtype``), as the runtime asks
ALL_SHAPES = dict(SHAPES, lm_head=(128256, 4096))


def graph_time(fns, reps: int = 20) -> float:
    """Seconds per call of ``fns`` (a list run back to back) replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps / len(fns)


GEMV2_SPACE = ([{"KERNEL": "gemv2", "BLOCK_N": bn, "BLOCK_K": bk, "CHAIN": 8, "num_warps": w, "num_stages": st}
                for bn in (128, 256, 512) for bk, w in ((256, 4), (512, 8)) for st in (1, 2)]
               # smaller programs (more of them in flight, shorter tails): session 7
               + [{"KERNEL": "gemv2", "BLOCK_N": bn, "BLOCK_K": bk, "CHAIN": 8, "num_warps": w, "num_stages": st}
                  for bn, bk, w in ((64, 128, 2), (64, 256, 4), (32, 256, 2), (64, 512, 4), (64, 512, 8), (64, 1024, 8),
                                    (32, 512, 4), (32, 1024, 4), (128, 1024, 8)) for st in (1, 2)]
               # the next step's loads issued before this step's math (PREFETCH 1) and 2048-wide
               # steps: session 9 (they won on qkv, o and gate_up at M = 2, qkv and o at M = 1)
               + [{"KERNEL": "gemv2", "BLOCK_N": bn, "BLOCK_K": bk, "CHAIN": 8, "num_warps": w, "num_stages": 1,
                   "PREFETCH": pf}
                  for bn, bk, w in ((64, 512, 8), (64, 1024, 8), (32, 1024, 4), (32, 512, 4), (64, 2048, 8),
                                    (32, 2048, 4)) for pf in (0, 1)])

# the swap-AB tensor-core kernel (group 128: BLOCK_K 64 or 128); BLOCK_M 8 (mma.sync) or 16 (wgmma)
SWAP_SPACE = ([{"KERNEL": "swap", "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": w, "num_stages": st, "PREFETCH": pf}
               for bn, w in ((128, 4), (128, 8), (256, 4), (256, 8)) for st in (2, 3, 4) for pf in (0, 1)]
              + [{"KERNEL": "swap", "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": st, "PREFETCH": 1}
                 for st in (3, 4)])


def _w4a16_space(M: int) -> list[dict]:
    """Launch configs swept for one M bucket (without SPLIT_K): the packed-half GEMV (M <= 4),
    the tensor-core kernel with x as the A operand (M >= 4) and the swap-AB one (all M)."""
    out = []
    if M <= 4:
        out += [dict(c, BLOCK_M=M) for c in GEMV2_SPACE]
    if M >= 4:
        for bn, w in ((64, 4), (128, 4), (128, 8)):
            out.append({"KERNEL": "mma", "BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": w, "num_stages": 2})
    out += [dict(c, BLOCK_M=bm) for c in SWAP_SPACE for bm in ((8,) if M <= 8 else (8, 16))]
    return out


def _warm(jobs) -> int:
    """Compile (populate Triton's cache) in a worker process: one call per (N, K, M, config)."""
    from kiln.kernels.w4a16 import w4a16_gemm

    ok = 0
    for N, K, M, cfg in jobs:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        qw = torch.zeros(K // 8, N, dtype=torch.int32, device="cuda")
        sc = torch.ones(K // 128, N, dtype=torch.float16, device="cuda")
        z = torch.zeros(K // 128, N, dtype=torch.uint8, device="cuda")
        try:
            w4a16_gemm(x, qw, sc, z, cfg)
            ok += 1
        except Exception:  # noqa: BLE001 - out of resources etc.: the sweep skips it
            pass
    torch.cuda.synchronize()
    return ok


def _weight_copies(N: int, K: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """bf16 weights [N, K] and their int4 packing (group 128), each copied often enough to fill
    >= 512 MB, so that calls rotating over the copies are not served from L2."""
    from kiln.runtime.quantization import int4

    w = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(2, (512 << 20) // (N * K * 2)))]
    s, z = int4.quantize_params(w[0].float(), 128)
    packed = int4.pack(int4.quantize_with(w[0].float(), s, z, 128), s, z)
    return w, [{k: v.clone() for k, v in packed.items()} for _ in range(max(2, (512 << 20) // (N * K // 2)))]


def bench_w4a16(ms=(1, 2, 4, 8, 16), splits=(1, 2, 4, 8, 16), procs: int = 12,
                shapes: dict[str, tuple[int, int]] | None = None) -> list[dict]:
    """Sweep the launch configs per shape (default ``SHAPES``) and M bucket, check the winner
    against the reference, then time it against bf16 cuBLAS; prints the winners as the
    ``"w4a16"`` entries of a tuning table (``kiln/kernels/tuning/<device>.json``)."""
    import multiprocessing as mp

    from kiln.kernels.w4a16 import w4a16_gemm, w4a16_ref

    table: dict[tuple[int, int, int], dict] = {}
    # the compiled variant depends on M's bucket, the config and split == 1 or not, not on the shape
    jobs = [(4096, 4096, M, dict(cfg, SPLIT_K=sp)) for M in ms for cfg in _w4a16_space(M)
            for sp in (1, 2)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(procs) as pool:
        pool.map(_warm, [jobs[i::procs] for i in range(procs)])
    print(json.dumps({"compile_s": time.perf_counter() - t0, "jobs": len(jobs)}), flush=True)
    rows = []
    for name, (N, K) in (shapes or SHAPES).items():
        w, q = _weight_copies(N, K)
        od = torch.float32 if name == "lm_head" else None
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            best = None
            per_kernel: dict[str, float] = {}  # best sweep time (us) of each kernel
            for cfg in _w4a16_space(M):
                for sp in splits:
                    c = dict(cfg, SPLIT_K=sp)
                    try:
                        t = graph_time([lambda p=p, c=c: w4a16_gemm(x, p["qweight"], p["scales"], p["qzeros"], c, od)
                                        for p in q[:16]], reps=5)
                    except Exception:  # noqa: BLE001 - resources exceeded etc.
                        continue
                    per_kernel[c["KERNEL"]] = min(per_kernel.get(c["KERNEL"], float("inf")), t * 1e6)
                    if best is None or t < best[0]:
                        best = (t, c)
            table[(N, K, M)] = best[1]
            packed = q[0]
            ref = w4a16_ref(x, packed["qweight"], packed["scales"], packed["qzeros"]).float()
            errs = []
            for _ in range(3):  # repeated: the split-K counters must come back to zero
                y = w4a16_gemm(x, packed["qweight"], packed["scales"], packed["qzeros"], best[1], od).float()
                errs.append(float((y - ref).norm() / ref.norm()))
            t_bf16 = graph_time([lambda wi=wi: x @ wi.t() for wi in w])
            t_w4 = graph_time([lambda p=p: w4a16_gemm(x, p["qweight"], p["scales"], p["qzeros"], best[1], od)
                               for p in q])
            nbytes = N * K / 2 + N * K // 128 * 3
            rows.append({"shape": name, "N": N, "K": K, "M": M,
                         "bf16_us": t_bf16 * 1e6, "w4a16_us": t_w4 * 1e6,
                         "speedup": t_bf16 / t_w4, "w4a16_GBps": nbytes / t_w4 / 1e9, "max_rel_err": max(errs),
                         "config": best[1], "sweep_us_by_kernel": {k: round(v, 2) for k, v in per_kernel.items()}})
            print(json.dumps(rows[-1]), flush=True)
        del w, q
    print('"w4a16": ' + json.dumps({f"{k[0]}x{k[1]}x{k[2]}": v for k, v in table.items()}), flush=True)
    return rows


def bench_w4a16_large(ms=(16, 32, 48, 64, 96, 128, 512, 2048, 8192)) -> list[dict]:
    """Larger M (prefill): the fused tensor-core kernel (``mma``, its default launch) vs
    dequantize-then-cuBLAS (``dequant``; the weight dequantization alone too) vs bf16 cuBLAS,
    per projection; each checked against the float32 reference.  Sets the crossover
    ``KernelOptions.w4a16_dequant_min_m``."""
    from kiln.kernels.w4a16 import choose_config, w4a16_gemm, w4a16_ref
    from kiln.kernels.w4a16.dequant import dequantize

    rows = []
    for name, (N, K) in SHAPES.items():
        w, qn = _weight_copies(N, K)
        del w[2:], qn[8:]
        t_deq = graph_time([lambda p=p: dequantize(p["qweight"], p["scales"], p["qzeros"], torch.bfloat16)
                            for p in qn], reps=5)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "M": M, "dequant_only_us": t_deq * 1e6}
            ref = w4a16_ref(x, qn[0]["qweight"], qn[0]["scales"], qn[0]["qzeros"]).float()
            mma = choose_config(M, N, K, 128, x.device, x.dtype, options=KernelOptions(w4a16_dequant_min_m=1 << 30))
            deq = {"KERNEL": "dequant", "BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 8,
                   "num_stages": 1}
            for tag, q, cfg in (("mma", qn, mma), ("dequant", qn, deq)):
                y = w4a16_gemm(x, q[0]["qweight"], q[0]["scales"], q[0]["qzeros"], cfg).float()
                row[f"{tag}_rel_err"] = float((y - ref).norm() / ref.norm())
                row[f"{tag}_us"] = graph_time([lambda p=p, c=cfg: w4a16_gemm(x, p["qweight"], p["scales"], p["qzeros"], c)
                                               for p in q], reps=5) * 1e6
            row["bf16_us"] = graph_time([lambda wi=wi: x @ wi.t() for wi in w], reps=5) * 1e6
            row["mma_config"] = mma["KERNEL"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del w, qn
    return rows


def bench_w4a16_variants(ms=(1, 2, 4), splits=(2, 4, 8, 16)) -> list[dict]:
    """Old ``gemv`` vs packed-half ``gemv2`` vs bf16 cuBLAS per shape and M (bf16 x, group 128).
    ``gemv2`` is swept over ``GEMV2_SPACE`` x ``splits`` (compiled in worker processes first);
    every timed kernel is checked against the float32 reference."""
    import multiprocessing as mp

    from kiln.kernels.w4a16 import choose_config, w4a16_gemm, w4a16_ref

    jobs = [(4096, 4096, M, dict(c, BLOCK_M=min(4, M), SPLIT_K=sp)) for M in ms for c in GEMV2_SPACE for sp in (1, 2)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(12) as pool:
        pool.map(_warm, [jobs[i::12] for i in range(12)])
    print(json.dumps({"compile_s": time.perf_counter() - t0, "jobs": len(jobs)}), flush=True)
    rows = []
    for name, (N, K) in SHAPES.items():
        w, q = _weight_copies(N, K)
        nbytes = N * K / 2 + N * K // 128 * 3
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            packed = q[0]
            ref = w4a16_ref(x, packed["qweight"], packed["scales"], packed["qzeros"]).float()

            def timed(c):
                y = w4a16_gemm(x, packed["qweight"], packed["scales"], packed["qzeros"], c).float()
                err = float((y - ref).norm() / ref.norm())
                t = graph_time([lambda p=p: w4a16_gemm(x, p["qweight"], p["scales"], p["qzeros"], c) for p in q])
                return t, err

            old = choose_config(M, N, K, 128, x.device, x.dtype, kernel="gemv")
            t_old, e_old = timed(old)
            best = None
            for c in GEMV2_SPACE:
                for sp in splits:
                    cfg = dict(c, BLOCK_M=min(4, M), SPLIT_K=sp)
                    try:
                        t = graph_time([lambda p=p: w4a16_gemm(x, p["qweight"], p["scales"], p["qzeros"], cfg)
                                        for p in q[:16]], reps=5)
                    except Exception:  # noqa: BLE001 - resources exceeded etc.
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
            t_new, e_new = timed(best[1])
            t_bf16 = graph_time([lambda wi=wi: x @ wi.t() for wi in w])
            rows.append({"shape": name, "N": N, "K": K, "M": M, "bf16_us": t_bf16 * 1e6,
                         "gemv_us": t_old * 1e6, "gemv2_us": t_new * 1e6,
                         "gemv_vs_bf16": t_bf16 / t_old, "gemv2_vs_bf16": t_bf16 / t_new,
                         "gemv_GBps": nbytes / t_old / 1e9, "gemv2_GBps": nbytes / t_new / 1e9,
                         "gemv_rel_err": e_old, "gemv2_rel_err": e_new, "gemv_config": old, "gemv2_config": best[1]})
            print(json.dumps(rows[-1]), flush=True)
        del w, q
    return rows


def _w4a16_and_norm(x: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, options: KernelOptions):
    """Two callables of one packed weight dict ``p``: the W4A16 GEMM of ``x``, and the same GEMM
    of the add + RMSNorm of ``x`` and ``res`` (weight ``nw``), as in a decode step; both
    launched with ``options``."""
    from kiln.kernels.norm import fused_add_rms_norm
    from kiln.kernels.w4a16 import w4a16_gemm

    def w4(p, a=x):
        return w4a16_gemm(a, p["qweight"], p["scales"], p["qzeros"], options=options)

    def w4n(p):
        return w4(p, fused_add_rms_norm(x, res, nw, 1e-5, options=options)[0])

    return w4, w4n


def bench_argmax(vocab: int = 128256, batches=(1, 4, 16)) -> list[dict]:
    """Greedy sampling's argmax over float32 logits: torch's ``argmax`` against the sampler's
    two-pass ``greedy_argmax``, microseconds per call (CUDA graph of 20 calls)."""
    from kiln.runtime.sampler import greedy_argmax

    rows = []
    for S in batches:
        logits = torch.randn(S, vocab, device="cuda")
        same = bool(torch.equal(greedy_argmax(logits), logits.argmax(-1)))
        row = {"S": S, "vocab": vocab, "argmax_us": graph_time([lambda: logits.argmax(-1)] * 20) * 1e6,
               "greedy_argmax_us": graph_time([lambda: greedy_argmax(logits)] * 20) * 1e6, "same": same}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def bench_pdl(ms=(1, 2, 4, 8, 16)) -> list[dict]:
    """Programmatic dependent launch (``kiln.kernels.pdl``, ``KernelOptions.pdl``) on and off.

    Per shape and M, the tuned W4A16 config: the GEMM chain of ``bench_w4a16`` (one CUDA graph
    over the weight copies), and, closer to a decode step, each GEMM preceded by the RMSNorm
    that feeds it ("norm+": time of the pair); bf16 cuBLAS and (where ``use_gemv``) Kiln's bf16
    GEMV on the same shapes.  Outputs with PDL on are checked against PDL off."""
    from kiln.kernels import gemv as gemv_mod
    from kiln.kernels.norm import fused_add_rms_norm

    rows = []
    for name, (N, K) in SHAPES.items():
        w, q = _weight_copies(N, K)
        nw = torch.ones(K, device="cuda", dtype=torch.bfloat16)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "M": M}
            for tag in ("off", "on"):
                opts = KernelOptions(pdl=tag == "on")
                w4, w4n = _w4a16_and_norm(x, res, nw, opts)

                def gv(wi, a=x, o=opts):
                    return gemv_mod.gemv(a, wi, options=o)

                def gvn(wi, o=opts):
                    return gv(wi, fused_add_rms_norm(x, res, nw, 1e-5, options=o)[0])

                y = w4(q[0]).float()
                if tag == "off":
                    ref = y
                else:
                    row["rel_diff_on_vs_off"] = float((y - ref).norm() / ref.norm())
                row[f"w4a16_{tag}_us"] = graph_time([lambda p=p: w4(p) for p in q]) * 1e6
                row[f"norm+w4a16_{tag}_us"] = graph_time([lambda p=p: w4n(p) for p in q]) * 1e6
                if gemv_mod.use_gemv(M, N, K):
                    row[f"gemv_{tag}_us"] = graph_time([lambda wi=wi: gv(wi) for wi in w]) * 1e6
                    row[f"norm+gemv_{tag}_us"] = graph_time([lambda wi=wi: gvn(wi) for wi in w]) * 1e6
                row[f"norm_{tag}_us"] = graph_time([lambda o=opts: fused_add_rms_norm(x, res, nw, 1e-5, options=o)
                                                    for _ in w]) * 1e6
            row["bf16_us"] = graph_time([lambda wi=wi: x @ wi.t() for wi in w]) * 1e6
            row["norm+bf16_us"] = graph_time([lambda wi=wi: fused_add_rms_norm(x, res, nw, 1e-5)[0] @ wi.t()
                                              for wi in w]) * 1e6
            row["speedup_on_vs_bf16"] = row["bf16_us"] / row["w4a16_on_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        del w, q
    return rows


def bench_read_floor() -> list[dict]:
    """The floor under any GEMV on this GPU: time to stream N bytes, per kernel, in the same
    setting as ``bench_w4a16`` (one CUDA graph over >= 512 MB of buffers, no L2 reuse).

    A Triton kernel reads each buffer once with 16-byte loads (every program a contiguous
    chunk, XOR-reduced into one word per program so the loads stay); the best of a small sweep
    (chunk 8-64 KB, 1024-4096 int32 per load step, 4/8 warps) per size.  Sizes: the int4 bytes
    (packed weights + float16 scales + uint8 zero points, group 128) and the bf16 bytes of the
    Llama-3.1-8B projections, with bf16 cuBLAS at M = 1 for reference."""
    import triton
    import triton.language as tl

    from kiln.kernels.pdl import launch_kwargs, pdl_start

    @triton.jit
    def _read(src, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pid = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK,), tl.int32)
        for i in tl.range(0, CHUNK, BLOCK):
            acc ^= tl.load(src + pid * CHUNK + i + tl.arange(0, BLOCK))
        tl.store(out + pid, tl.xor_sum(acc, axis=0))

    rows = []
    sizes = {}
    for name, (N, K) in SHAPES.items():
        sizes[f"{name}_int4"] = N * K // 2 + N * K // 128 * 3
        sizes[f"{name}_bf16"] = N * K * 2
    for name, nbytes in sizes.items():
        best = None
        for chunk_kb in (8, 16, 32, 64):
            chunk = chunk_kb * 256  # int32 words
            words = -(-nbytes // 4 // chunk) * chunk
            bufs = [torch.empty(words, dtype=torch.int32, device="cuda").random_()
                    for _ in range(max(2, (512 << 20) // (words * 4)))]
            out = torch.empty(words // chunk, dtype=torch.int32, device="cuda")
            for block in (1024, 2048, 4096):
                for warps in (4, 8):
                    if block > chunk:
                        continue
                    t = graph_time([lambda b=b: _read[(words // chunk,)](b, out, CHUNK=chunk, BLOCK=block,
                                                                         num_warps=warps,
                                                                         **launch_kwargs(b.device))
                                    for b in bufs])
                    if best is None or t < best[0]:
                        best = (t, {"chunk_KB": chunk_kb, "BLOCK": block, "num_warps": warps})
            del bufs
        row = {"what": name, "MB": nbytes / 1e6, "floor_us": best[0] * 1e6, "TBps": nbytes / best[0] / 1e12,
               "config": best[1]}
        if name.endswith("_bf16"):
            N, K = SHAPES[name[:-5]]
            w = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, (512 << 20) // (N * K * 2)))]
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            row["cublas_m1_us"] = graph_time([lambda wi=wi: x @ wi.t() for wi in w]) * 1e6
            row["cublas_over_3_us"] = row["cublas_m1_us"] / 3
            del w
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_fp8(ms=(1024, 4096, 8192)) -> list[dict]:
    from triton.testing import do_bench

    from kiln.runtime.quantization.fp8 import quantize_rows_fp8

    rows = []
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_rows_fp8(w)
        ws = ws.view(1, -1)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows_fp8(x)
            t_bf16 = do_bench(lambda: x @ w.t(), warmup=10, rep=50)
            t_mm = do_bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16),
                            warmup=10, rep=50)
            t_fast = do_bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                                                       use_fast_accum=True), warmup=10, rep=50)
            ref = (xq.float() * xs) @ (wq.float() * ws.view(-1, 1)).t()
            err = {f: float((torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                                              use_fast_accum=f).float() - ref).norm() / ref.norm()) for f in (False, True)}

            from kiln.kernels.fp8_quant import per_token_quant_fp8

            def full():
                a, sa = per_token_quant_fp8(x)
                return torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=ws, out_dtype=torch.bfloat16)

            t_full = do_bench(full, warmup=10, rep=50)
            fl = 2 * M * N * K
            rows.append({"shape": name, "M": M, "N": N, "K": K, "bf16_TFLOPs": fl / t_bf16 / 1e9,
                         "fp8_mm_TFLOPs": fl / t_mm / 1e9, "fp8_with_act_quant_TFLOPs": fl / t_full / 1e9,
                         "speedup_mm": t_bf16 / t_mm, "speedup_with_act_quant": t_bf16 / t_full,
                         "fp8_fast_accum_TFLOPs": fl / t_fast / 1e9, "speedup_fast_accum": t_bf16 / t_fast,
                         "rel_err": err[False], "rel_err_fast_accum": err[True]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_decode(methods=("bf16", "int4", "fp8"), new_tokens: int = 128, batch: int = 1,
                 profile_tokens: int = 0) -> list[dict]:
    """Greedy decode of ``batch`` 32-token prompts (``new_tokens`` each) per weight method:
    output tokens/s and ms per step (one token per sequence).  With ``profile_tokens`` > 0, a
    further generate of that many tokens runs under the torch profiler and each row gets
    ``profile``: the 16 kernels of most GPU time, as (name, microseconds per step, launches per
    step), and ``profile_gpu_us``, the GPU time of all kernels per step.

    Methods: ``bf16``, ``int4``, ``fp8``, ``int4-lmhead`` (the LM head quantized too); a
    ``-nopdl`` suffix launches without programmatic dependent launch (``EngineArgs.pdl``),
    ``-unfused`` runs rotary and the KV write as two kernels (``EngineArgs.fused_rope_kv``)."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.model_runner import ModelRunner
    from kiln.runtime.quantization.rtn import quantize_model_rtn
    from kiln.runtime.sampling_params import SamplingParams

    rows = []
    orig = ModelRunner.init_dummy_weights
    for method in methods:
        def patched(self, seed=0, _m=method):
            torch.manual_seed(seed)  # on-device random init (the CPU generator is slow for 8B)
            for name, prm in self.model.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    prm.data.fill_(1.0)
                else:
                    prm.data.normal_(0.0, 0.02)
            if _m.split("-")[0] != "bf16":  # "int4-lmhead": the LM head quantized too
                quantize_model_rtn(self.model, _m.split("-")[0], lm_head="lmhead" in _m.split("-"))

        ModelRunner.init_dummy_weights = patched
        parts = method.split("-")
        try:
            t0 = time.perf_counter()
            llm = LLM(model="builtin:llama-3.1-8b", load_format="dummy", max_num_seqs=max(8, batch), num_kv_blocks=512,
                      max_model_len=1024, pdl="nopdl" not in parts, fused_rope_kv="unfused" not in parts)
            load_s = time.perf_counter() - t0
            sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
            prompt = [list(range(1000 + 40 * i, 1032 + 40 * i)) for i in range(batch)]
            llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = llm.generate(prompt, sp)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in out)
            rows.append({"method": method, "batch": batch, "new_tokens": n, "tok_s": n / wall,
                         "ms_per_token": wall / (n / batch) * 1e3,
                         "load_s": load_s, "weights_GiB": torch.cuda.memory_allocated() / 2**30})
            if profile_tokens > 0:
                rows[-1].update(_profile_decode(llm, prompt, profile_tokens))
            print(json.dumps(rows[-1]), flush=True)
            del llm
            torch.cuda.empty_cache()
        finally:
            ModelRunner.init_dummy_weights = orig
    return rows


def _profile_decode(llm, prompt, tokens: int) -> dict:
    """Per-kernel GPU time of ``tokens`` decode steps (the prefill's few kernels are included
    but are a small share over a long generate)."""
    from torch.profiler import ProfilerActivity, profile

    from kiln.runtime.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, sp)
        torch.cuda.synchronize()
    ka = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    top = sorted(ka, key=lambda e: e.self_device_time_total, reverse=True)[:16]
    return {"profile_gpu_us": sum(e.self_device_time_total for e in ka) / tokens,
            "profile": [(e.key[:70], round(e.self_device_time_total / tokens, 2), round(e.count / tokens, 2))
                        for e in top]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--only", default="w4a16,fp8,decode",
                   help="comma list of w4a16, w4a16-large (prefill M: fused mma vs dequantize + cuBLAS vs bf16), "
                        "w4a16-variants (gemv vs gemv2 vs bf16), pdl, argmax (greedy sampling's argmax), floor, fp8, "
                        "decode")
    p.add_argument("--ms", default="1,2,4,8,16", help="M values of the w4a16 sweeps")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"shapes of the w4a16 sweep, a comma list of {', '.join(ALL_SHAPES)}")
    p.add_argument("--decode-methods", default="bf16,int4,fp8",
                   help="bf16, int4, int4-lmhead (the LM head quantized too), fp8; a -nopdl suffix turns PDL off, "
                        "-unfused runs rotary and the KV write as two kernels")
    p.add_argument("--w4a16-variants", action="store_true", help="same as adding w4a16-variants to --only")
    p.add_argument("--decode-batch", type=int, default=1, help="sequences decoded together in the decode part")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench measures GPU kernels and needs a CUDA device (none is visible)")
    if a.decode_batch < 1:
        raise SystemExit(f"--decode-batch must be >= 1, got {a.decode_batch}")
    only = set(a.only.split(","))
    if a.w4a16_variants:
        only.add("w4a16-variants")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "w4a16-variants" in only:
        res["w4a16_variants"] = bench_w4a16_variants()
    ms = tuple(int(m) for m in a.ms.split(","))
    unknown = [n for n in a.shapes.split(",") if n not in ALL_SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {', '.join(ALL_SHAPES)}")
    shapes = {n: ALL_SHAPES[n] for n in a.shapes.split(",")}
    if "w4a16" in only:
        res["w4a16"] = bench_w4a16(ms, shapes=shapes)
    if "w4a16-large" in only:
        res["w4a16_large"] = bench_w4a16_large()
    if "pdl" in only:
        res["pdl"] = bench_pdl()
    if "argmax" in only:
        res["argmax"] = bench_argmax()
    if "floor" in only:
        res["read_floor"] = bench_read_floor()
    if "fp8" in only:
        res["fp8"] = bench_fp8()
    if "decode" in only and not a.skip_decode:
        res["decode"] = bench_decode(tuple(a.decode_methods.split(",")), batch=a.decode_batch)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
