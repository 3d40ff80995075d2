"""End-to-end GPU checks and benchmarks for the H200 (run through the `device` tool; never in
CI).  Prints a summary table last; writes JSON to $OUT when set.

    python3 benchmarks/gpu_checks.py [--quick] [--skip-peer]

1. copy bandwidth (device-to-device, read + write bytes);
2. greedy equivalence: Kiln vs transformers on the same random weights (float32) of a real
   Llama-3 architecture with fewer layers;
3. batch-1 decode TPOT of Llama-3.1-8B (bf16, random weights) vs the weight-bandwidth roofline;
4. offline throughput, Llama-3.1-8B bf16, fixed 1000/1000 (and 128/128, 2048/128), with
   transformers' continuous batching as the peer on the same prompts;
5. a torch-profiler breakdown of a decode step (largest costs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

RESULTS: dict = {}


def log(*a):
    print(*a, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_log.txt"), "a") as f:
            print(*a, file=f)


def copy_bandwidth() -> float:
    n = 1 << 30  # 1 GiB of bf16
    a = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(20):
        b.copy_(a)
    t1.record()
    torch.cuda.synchronize()
    s = t0.elapsed_time(t1) / 1e3 / 20
    bw = 2 * n / s / 1e12
    RESULTS["copy_TBps"] = bw
    log(f"[copy] {bw:.2f} TB/s (read+write)")
    return bw


def greedy_equivalence() -> None:
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.bench import build_hf_peer, make_workload

    # Llama-3.2-1B's shape (GQA 32/8, llama3 RoPE scaling, tied embeddings), 4 layers, fp32.
    # A 64-token step budget chunks the prompts, so decodes share steps with prefill chunks
    # (mixed batches: decode kernel + prefill kernel) as well as running alone (CUDA graphs).
    llm = LLM(model="builtin:llama-3.2-1b", load_format="dummy", dtype="float32", max_num_seqs=16,
              num_kv_blocks=2048, max_model_len=1024, max_num_batched_tokens=64)
    cfg = llm.engine.model_config
    # Stronger random weights than 0.02 so logits are peaked (fewer near-ties).
    g = torch.Generator(device="cpu").manual_seed(1)
    for name, p in llm.engine.runner.model.named_parameters():
        if "norm" not in name:
            p.data.copy_(torch.randn(p.shape, generator=g).mul_(0.05).to(p.dtype))
    hf = build_hf_peer(llm)
    wl = make_workload(8, 100, 32, 0.8, cfg.vocab_size, seed=3)
    outs = llm.generate(wl.prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False))
    match = 0
    first_div = []
    with torch.inference_mode():
        for p, o in zip(wl.prompts, outs):
            inp = torch.tensor([p], device="cuda")
            ref = hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=32,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            got = o.outputs[0].token_ids[: len(ref)]  # transformers stops at EOS
            match += got == ref
            first_div.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None))
    RESULTS["greedy_equal_fp32"] = f"{match}/{len(outs)}"
    RESULTS["greedy_first_divergence"] = first_div
    log(f"[equiv] Kiln == transformers greedy (fp32, random weights, graphs on): {match}/{len(outs)}; "
        f"first divergence per prompt: {first_div}")
    del llm, hf
    torch.cuda.empty_cache()


def smollm2_equivalence(gguf_path: str, new_tokens: int = 24) -> None:
    """Greedy outputs of Kiln on the GPU (Triton kernels, CUDA graphs, a 32-token step budget
    so prompts are chunked and decodes share steps with prefill chunks) against transformers
    loading the same SmolLM2-135M-Instruct GGUF (``gguf_file=``), on the 16 prompts of the CPU
    correctness tests (tests/runtime/prompts.py: raw and chat-templated), float32 on both
    sides; then bfloat16 on both sides (near-ties may differ there: reported, not required)."""
    from transformers import AutoModelForCausalLM

    from kiln.runtime import LLM, SamplingParams

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
    from prompts import CHATS, RAW_PROMPTS  # noqa: PLC0415

    d, name = os.path.split(gguf_path)
    for dtype, tdt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        llm = LLM(model=gguf_path, dtype=dtype, max_num_seqs=16, max_num_batched_tokens=32, max_model_len=2048)
        tok = llm.engine.tokenizer
        prompts = [list(tok.encode(p)) for p in RAW_PROMPTS]
        for chat in CHATS:
            t = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            prompts.append(list(t["input_ids"] if hasattr(t, "keys") else t))
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                                                    detokenize=False))
        del llm
        torch.cuda.empty_cache()
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=tdt).cuda().eval()
        match, first_div = 0, []
        with torch.inference_mode():
            for p, o in zip(prompts, outs):
                inp = torch.tensor([p], device="cuda")
                ref = hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=2)[0, len(p):].tolist()
                got = o.outputs[0].token_ids[: len(ref)]  # transformers stops at EOS
                match += got == ref
                first_div.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None))
        del hf
        torch.cuda.empty_cache()
        RESULTS[f"smollm2_greedy_equal_{dtype}"] = f"{match}/{len(prompts)}"
        log(f"[smollm2] Kiln (GPU, graphs, chunked prefill) == transformers greedy, {dtype}: {match}/{len(prompts)}; "
            f"first divergence per prompt: {first_div}")


KV_FRACTION = [0.85]


def llama8b(**kw):
    from kiln.runtime import LLM

    kw.setdefault("kv_cache_memory_fraction", KV_FRACTION[0])
    return LLM(model="builtin:llama-3.1-8b", load_format="dummy", dtype="bfloat16", **kw)


def set_async(llm, on: bool) -> None:
    """Switch asynchronous scheduling between generate() calls (no request is live then)."""
    llm.engine.async_scheduling = on
    llm.engine.scheduler.config.async_scheduling = on


def batch1_decode(llm, copy_bw: float) -> None:
    for on in (False, True):
        set_async(llm, on)
        _batch1_decode(llm, copy_bw, "async" if on else "sync")


def _batch1_decode(llm, copy_bw: float, tag: str) -> None:
    from kiln.runtime import SamplingParams

    cfg = llm.engine.model_config
    wl_prompt = [list(range(1000, 1128))]
    sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False)
    llm.generate(wl_prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False))
    o = llm.generate(wl_prompt, sp)[0]
    m = o.metrics
    tpot = (m["last_token_time"] - m["first_token_time"]) / (len(o.outputs[0].token_ids) - 1)
    wbytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    roof = wbytes / (copy_bw * 1e12)
    RESULTS[f"b1_{tag}_tpot_ms"] = tpot * 1e3
    RESULTS["b1_roofline_ms"] = roof * 1e3
    RESULTS[f"b1_{tag}_fraction_of_roofline"] = roof / tpot
    log(f"[b1 {tag}] TPOT {tpot*1e3:.2f} ms; roofline {roof*1e3:.2f} ms ({wbytes/1e9:.1f} GB weights); "
        f"{roof/tpot*100:.1f}% of roofline")


def profile_decode(llm) -> None:
    for on in (False, True):
        set_async(llm, on)
        _profile_decode(llm, "async" if on else "sync")


def _profile_decode(llm, tag: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from kiln.runtime import SamplingParams

    prompts = [[1000 + i] * 64 for i in range(64)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in ka) / 1e6
    RESULTS[f"profile_{tag}_gpu_busy_fraction"] = gpu_total / wall
    top = sorted(ka, key=lambda e: e.self_device_time_total, reverse=True)[:8]
    RESULTS[f"profile_{tag}_top"] = [(e.key[:60], round(e.self_device_time_total / 1e3, 2)) for e in top]
    cpu_top = sorted((e for e in ka if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total,
                     reverse=True)[:8]
    RESULTS[f"profile_{tag}_cpu_top"] = [(e.key[:60], round(e.self_cpu_time_total / 1e3, 2)) for e in cpu_top]
    log(f"[profile {tag}] batch 64 x 24 tokens: wall {wall:.2f}s, GPU busy {gpu_total:.2f}s "
        f"({gpu_total/wall*100:.0f}%); top GPU kernels (ms): {RESULTS[f'profile_{tag}_top']}; "
        f"top CPU (ms): {RESULTS[f'profile_{tag}_cpu_top']}")


def profile_steps(llm, batch: int, prompt_len: int, steps: int = 12) -> None:
    """Kernel breakdown of decode steps at ``batch`` sequences of ``prompt_len`` context:
    GPU time per kernel per step (us), and the GPU-busy fraction of the decode phase."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from kiln.runtime import SamplingParams

    eng = llm.engine
    prompts = [[(1000 + i * 7 + j) % eng.model_config.vocab_size for j in range(prompt_len)] for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True, detokenize=False)
    # Enough tokens that no request finishes while the last prompts are still prefilled
    # (an earlier version used steps + 8 and profiled a partly drained batch).
    prefill_steps = -(-batch * prompt_len // eng.args.max_num_batched_tokens)
    for p in prompts:
        eng.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=prefill_steps + steps + 8, ignore_eos=True,
                                                detokenize=False))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()) \
            or eng.scheduler.num_waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    running = len(eng.scheduler.running)
    while eng.has_unfinished_requests():
        eng.step()
    ka = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in ka) / 1e6
    rows = sorted(ka, key=lambda e: e.self_device_time_total, reverse=True)[:14]
    table = [(e.key[:50], e.count // steps, round(e.self_device_time_total / steps, 1)) for e in rows]
    key = f"steps_b{batch}_ctx{prompt_len}"
    RESULTS[key] = {"running": running, "step_ms": wall / steps * 1e3, "gpu_ms_per_step": gpu_total / steps * 1e3,
                    "gpu_busy": gpu_total / wall, "kernels_us_per_step": table}
    log(f"[steps] batch {batch} ctx {prompt_len}: {wall/steps*1e3:.2f} ms/step, GPU {gpu_total/steps*1e3:.2f} ms/step "
        f"({gpu_total/wall*100:.0f}% busy); per step (name, launches, us): {table}")
    del sp


def run_profile(llm, n: int = 1000, il: int = 1000, ol: int = 1000, prof_at: tuple | None = (700, 1150),
                tag: str = "") -> None:
    """The real 1000/1000 run with a per-step log: host time per step (with asynchronous
    scheduling the host waits on the previous step, so in steady state this is the GPU step
    time) by step kind (decode-only vs carrying prefill tokens) and batch, plus a torch
    profiler kernel breakdown over a few steps around ``prof_at`` (one decode-only window,
    one with prefill chunks)."""
    from torch.profiler import ProfilerActivity, profile

    from kiln.runtime import SamplingParams
    from kiln.runtime.bench import make_workload

    eng = llm.engine
    cfg = eng.model_config
    wl = make_workload(n, il, ol, 0.0, cfg.vocab_size, seed=0)
    llm.generate([wl.prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))
    for p, o in zip(wl.prompts, wl.output_lens):
        eng.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False))
    sched = eng.scheduler
    orig = sched.schedule
    log_rows = []

    def logged():
        out = orig()
        ctx = sum(sr.request.num_computed_tokens for sr in out.scheduled)
        log_rows.append((time.perf_counter(), out.num_decode_tokens, out.num_prefill_tokens, len(out.scheduled), ctx))
        return out

    sched.schedule = logged
    runner = eng.runner
    orig_exec = runner.execute_async
    launch_ms = {"decode": [], "mixed": []}

    def timed_exec(out, rows):
        t = time.perf_counter()
        r = orig_exec(out, rows)
        launch_ms["mixed" if out.num_prefill_tokens else "decode"].append((time.perf_counter() - t) * 1e3)
        return r

    runner.execute_async = timed_exec
    windows = {}
    prof = None
    prof_state = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n_out = 0
    try:
        while eng.has_unfinished_requests():
            k = len(log_rows)
            if prof_at is None:
                pass
            elif prof is None and prof_state is None and k >= prof_at[0] and log_rows and log_rows[-1][2] == 0:
                prof_state = "decode"
                prof = profile(activities=[ProfilerActivity.CUDA]); prof.__enter__(); windows[prof_state] = [k, None]
            elif prof is None and prof_state == "decode_done" and k >= prof_at[1] and log_rows[-1][2] > 0:
                prof_state = "mixed"
                prof = profile(activities=[ProfilerActivity.CUDA]); prof.__enter__(); windows[prof_state] = [k, None]
            outs = eng.step()
            n_out += sum(1 for o in outs if o.finished)
            if prof is not None and len(log_rows) - windows[prof_state][0] >= 12:
                torch.cuda.synchronize()
                prof.__exit__(None, None, None)
                windows[prof_state][1] = len(log_rows)
                ka = prof.key_averages()
                steps = windows[prof_state][1] - windows[prof_state][0]
                rows = log_rows[windows[prof_state][0]:windows[prof_state][1]]
                gpu = sum(e.self_device_time_total for e in ka) / 1e3 / steps
                top = sorted(ka, key=lambda e: e.self_device_time_total, reverse=True)[:16]
                table = [(e.key[:60], round(e.count / steps, 1), round(e.self_device_time_total / steps / 1e3, 3)) for e in top]
                RESULTS[f"runprof_{prof_state}"] = {"steps": steps, "gpu_ms_per_step": gpu, "batch": [r[3] for r in rows][:3],
                                                   "prefill_tokens": [r[2] for r in rows], "kernels_ms_per_step": table}
                log(f"[runprof {prof_state}] {steps} steps at step {windows[prof_state][0]}: GPU {gpu:.2f} ms/step "
                    f"(under the profiler); seqs {[r[3] for r in rows][:3]}, prefill tokens {[r[2] for r in rows]}, "
                    f"sum ctx {rows[0][4]}; per step (name, launches, ms): {table}")
                prof = None
                prof_state = "decode_done" if prof_state == "decode" else "mixed_done"
    finally:
        sched.schedule = orig
        runner.execute_async = orig_exec
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    # per-step durations: from one schedule() call to the next
    dec_t = dec_n = mix_t = mix_n = 0.0
    mix_pf = 0
    by_batch: dict = {}
    skip = set()
    for w in windows.values():
        skip.update(range(w[0] - 1, (w[1] or w[0]) + 1))
    for i in range(len(log_rows) - 1):
        if i in skip:
            continue
        dt = log_rows[i + 1][0] - log_rows[i][0]
        _, nd, npf, ns, ctx = log_rows[i]
        if npf == 0:
            dec_t += dt
            dec_n += 1
            b = min(512, (ns + 31) // 32 * 32)
            by_batch.setdefault(b, [0, 0.0, 0])
            by_batch[b][0] += 1
            by_batch[b][1] += dt
            by_batch[b][2] += ctx
        else:
            mix_t += dt
            mix_n += 1
            mix_pf += npf
    lm = {k: (round(sum(v) / max(len(v), 1), 2), round(max(v or [0]), 1)) for k, v in launch_ms.items()}
    RESULTS[f"runprof{tag}"] = {"launch_ms_mean_max": lm, "wall_s": wall, "tok_s": n * ol / wall, "steps": len(log_rows),
                          "decode_steps": dec_n, "decode_s": dec_t, "mixed_steps": mix_n, "mixed_s": mix_t,
                          "mixed_prefill_tokens": mix_pf,
                          "decode_by_batch": {b: {"steps": v[0], "ms_per_step": v[1] / v[0] * 1e3,
                                                  "avg_ctx": v[2] / v[0] / max(b, 1)} for b, v in sorted(by_batch.items())}}
    log(f"[runprof{tag}] host launch ms (mean, max) {lm}; budget {eng.args.max_num_batched_tokens}, "
        f"max_num_seqs {eng.args.max_num_seqs}")
    log(f"[runprof{tag}] {n} x {il}/{ol}: wall {wall:.1f}s = {n*ol/wall:.0f} tok/s, {len(log_rows)} steps; decode-only "
        f"{dec_n} steps {dec_t:.1f}s; with prefill {mix_n} steps {mix_t:.1f}s ({mix_pf} prefill tokens, "
        f"{mix_t/max(mix_pf,1)*1e6:.1f} us/prefill token incl. their decodes); by batch: "
        f"{RESULTS[f'runprof{tag}']['decode_by_batch']}")


def fp8_throughput(max_num_seqs: int, fp8_kv: bool = False, kv_fraction: float = 0.85, budget: int = 8192) -> None:
    """1000 x 1000/1000 with the 8B shape's weights quantized to FP8 (W8A8, per-channel /
    per-token scales, ``torch._scaled_mm``) right after the random init; with ``fp8_kv`` also
    an FP8 E4M3 KV cache (per-head scales of a fixed range: the weights are random)."""
    from kiln.runtime.model_runner import ModelRunner
    from kiln.runtime.quantization.rtn import quantize_model_rtn

    orig = ModelRunner.init_dummy_weights

    def patched(self, seed=0):
        orig(self, seed)
        quantize_model_rtn(self.model, "fp8")
        if fp8_kv:
            from kiln.runtime.quantization import kv_fp8
            hkv = self.model_config.num_key_value_heads
            n = self.model_config.num_hidden_layers
            kv_fp8.install_scales(self.model, kv_fp8.scale_tensors([(torch.full((hkv,), 4.0),) * 2] * n), self.device)
            self.kv_cache_torch_dtype = kv_fp8.KV_DTYPE

    ModelRunner.init_dummy_weights = patched
    try:
        llm = llama8b(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                      kv_cache_memory_fraction=kv_fraction)
    finally:
        ModelRunner.init_dummy_weights = orig
    tag = "fp8_fp8kv_" if fp8_kv else "fp8_"
    log(f"[load] llama-3.1-8b dummy {tag}: {llm.engine.runner.num_kv_blocks} KV blocks "
        f"({llm.engine.runner.kv_cache_dtype()}), max_num_seqs {max_num_seqs}, max_num_batched_tokens {budget}")
    throughput(llm, 1000, 1000, 1000, None, tag=tag + f"s{max_num_seqs}_")
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def gemm_sweep(ms=(128, 192, 256, 320, 352, 384, 400, 416, 448, 480, 512, 640, 768, 1024, 4096), fp8: bool = False) -> None:
    """bf16 cuBLAS ``F.linear`` TFLOP/s of the 8B shape's four weight GEMMs against the batch
    size M (decode steps run at M = number of running sequences): which max_num_seqs keep the
    GEMM tiles full.  CUDA graph of 16 calls rotating over weight copies (>= 256 MB, no L2 reuse)."""
    import torch.nn.functional as F

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    res = {}
    for name, (n, k) in shapes.items():
        copies = max(2, (256 << 20) // (n * k * 2) + 1)
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
        if fp8:  # what kiln.runtime.quantization.fp8 runs: _scaled_mm, rowwise scales (no activation quant)
            ws = [w.to(torch.float8_e4m3fn) for w in ws]
            w_scale = torch.ones(1, n, dtype=torch.float32, device="cuda")

        def gemm(x, w):
            if fp8:
                return torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
            return F.linear(x, w)

        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            if fp8:
                x = x.to(torch.float8_e4m3fn)
                x_scale = torch.ones(m, 1, dtype=torch.float32, device="cuda")
            calls = 16
            for w in ws[:2]:
                gemm(x, w)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(calls):
                    gemm(x, ws[i % copies])
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(4):
                    g.replay()
                t1.record()
                torch.cuda.synchronize()
                times.append(t0.elapsed_time(t1) / (4 * calls))
            ms_ = sorted(times)[len(times) // 2]
            tf = 2 * m * n * k / (ms_ * 1e-3) / 1e12
            res[f"{name}_M{m}"] = {"us": ms_ * 1e3, "tflops": tf}
            del g
        del ws
        torch.cuda.empty_cache()
    for m in ms:
        tot_us = sum(res[f"{nm}_M{m}"]["us"] for nm in shapes)
        flops = 2 * m * sum(n * k for n, k in shapes.values())
        log(f"[gemm{'-fp8' if fp8 else ''}] M={m:5d} " + " ".join(f"{nm} {res[f'{nm}_M{m}']['us']:7.1f}us/{res[f'{nm}_M{m}']['tflops']:4.0f}"
                                           for nm in shapes)
            + f" | layer {tot_us:7.1f} us {flops / tot_us / 1e6:5.0f} TFLOP/s, {tot_us / m * 1e3:6.1f} ns/token")
    RESULTS["gemm_sweep_fp8" if fp8 else "gemm_sweep"] = res


def sampler_timing(batch: int = 256, vocab: int = 128256) -> None:
    """Wall time of one sampling step (``sample_on_device`` + reading the ids) for a batch of
    Llama-3 logits: greedy, sampled rows drawn together (temperature 0.8, top-k 50, top-p
    0.95), and the same rows each with a seed (drawn one by one, as before 2026-12-01)."""
    from kiln.runtime.sampler import SamplingRow, sample_on_device
    from kiln.runtime.sampling_params import SamplingParams

    logits = torch.randn(batch, vocab, device="cuda") * 3
    cases = {
        "greedy": lambda: [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(batch)],
        "sampled_batched": lambda: [SamplingRow(SamplingParams(temperature=0.8, top_k=50, top_p=0.95), [1], [], None)
                                    for _ in range(batch)],
        "sampled_seeded_per_row": lambda: [SamplingRow(SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i), [1], [],
                                                       torch.Generator(device="cuda").manual_seed(i)) for i in range(batch)],
    }
    res = {}
    for name, mk in cases.items():
        rows = mk()
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sample_on_device(logits.clone(), rows).token_ids.tolist()
            times.append(time.perf_counter() - t0)
        res[name] = sorted(times[1:])[2] * 1e3
        log(f"[sampler] batch {batch} vocab {vocab} {name}: {res[name]:.2f} ms/step")
    RESULTS["sampler_ms"] = res


FP8_DECODE_CANDIDATES = [  # 2026-12-01 also tried: several KV heads per program (block-diagonal q tile), slower
    {"BLOCK_N": bn, "num_warps": w, "num_stages": st, "maxnreg": r}
    for bn, w, st, r in [(128, 4, 3, 168), (128, 4, 3, None), (128, 4, 2, 168), (128, 8, 3, None), (256, 8, 2, None),
                         (64, 4, 3, 128)]
]


def pick_fp8_decode(batch: int = 512) -> None:
    """Time the fp8-cache decode attention at the 1000/1000 run's shape (``batch`` sequences,
    contexts 1,000-2,000) over ``FP8_DECODE_CANDIDATES`` (tile, warps, stages, register cap),
    check each against the reference, and make the fastest the
    ``tuning.ATTENTION["decode_fp8"]`` entry for the rest of this process."""
    from attn_sweep import make_problem, ref, run  # noqa: PLC0415
    from kiln.kernels import tuning
    from kernel_bench import graph_time  # benchmarks/kernel_bench.py

    p, nbytes = make_problem(batch, 1000, 2000, fp8=True)
    want = ref(p, 4)
    base = dict(tuning.ATTENTION["decode_fp8"])
    rows = []
    for cand in FP8_DECODE_CANDIDATES:
        cfg = dict(base)
        cfg.pop("maxnreg", None)
        cfg.update({k: v for k, v in cand.items() if v is not None})
        try:
            err = ((run(p, 4, config=cfg).float() - want).norm() / want.norm()).item()
            ms = graph_time([lambda: run(p, config=cfg)], target_ms=60)
        except Exception as e:  # out of resources: skip
            log(f"[fp8pick] {cand}: {type(e).__name__} {str(e)[:80]}")
            continue
        rows.append((ms, err, cfg))
        log(f"[fp8pick] B{batch} {cand}: {ms * 1e3:.1f} us, {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s, err {err:.1e}")
    ok = [r for r in rows if r[1] < 2e-2]
    best = min(ok, key=lambda r: r[0])
    tuning.ATTENTION["decode_fp8"] = best[2]
    RESULTS["fp8_decode_pick"] = {"us": best[0] * 1e3, "config": best[2],
                                  "all": [(r[0] * 1e3, r[2]) for r in rows]}
    log(f"[fp8pick] chosen {best[2]}: {best[0] * 1e3:.1f} us")
    del p
    torch.cuda.empty_cache()


def throughput(llm, n, il, ol, peer_n: int | None, tag: str = "") -> None:
    from kiln.runtime.bench import build_hf_peer, make_workload, run_hf_continuous, run_kiln_offline

    cfg = llm.engine.model_config
    wl = make_workload(n, il, ol, 0.0, cfg.vocab_size, seed=0)
    r = run_kiln_offline(llm, wl)
    key = f"{tag}tput_{n}x{il}/{ol}"
    RESULTS[key] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
    log(f"[tput] {tag}kiln {n} x {il}/{ol}: {r['output_tok_s']:.0f} out tok/s, {r['requests_s']:.2f} req/s, "
        f"TTFT p50 {r['ttft_p50_s']*1e3:.0f} ms p99 {r['ttft_p99_s']*1e3:.0f} ms, "
        f"TPOT p50 {r['tpot_p50_s']*1e3:.1f} ms p99 {r['tpot_p99_s']*1e3:.1f} ms, wall {r['wall_s']:.1f}s, "
        f"{r['steps']} steps, {r['preemptions']} preemptions, {llm.engine.runner.num_kv_blocks} KV blocks")
    if peer_n:
        from kiln.runtime.bench import Workload
        sub = Workload(wl.prompts[:peer_n], wl.output_lens[:peer_n])
        rk = r if peer_n >= n else run_kiln_offline(llm, sub)
        hf = build_hf_peer(llm)
        try:
            rp = run_hf_continuous(hf, sub)
        except Exception as e:  # report and go on
            rp = {"engine": "transformers.generate_batch", "error": repr(e)[:300], "output_tok_s": float("nan")}
        del hf
        torch.cuda.empty_cache()
        RESULTS[key + "_peer_subset"] = {"n": peer_n, "kiln_tok_s": rk["output_tok_s"],
                                         "transformers_cb_tok_s": rp.get("output_tok_s"),
                                         "ratio": rk["output_tok_s"] / rp["output_tok_s"] if rp.get("output_tok_s") else None,
                                         "peer_error": rp.get("error")}
        log(f"[peer] same {peer_n} requests: kiln {rk['output_tok_s']:.0f} tok/s vs transformers CB "
            f"{rp.get('output_tok_s')} tok/s {rp.get('error', '')}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--stage", default="all",
                    help="comma list: copy,gemm,equiv,b1,profile,tput,tput8b,fixed8b,peer1b,peer8b")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--fp8kv-max-num-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens of the bf16 8B runs")
    ap.add_argument("--kv-fraction", type=float, default=0.85, help="kv_cache_memory_fraction of the 8B runs")
    ap.add_argument("--peer-n", type=int, default=128, help="requests of the 1000/1000 subset for peer8b")
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct GGUF for the smollm2 stage")
    ns = ap.parse_args()
    KV_FRACTION[0] = ns.kv_fraction
    stages = set(ns.stage.split(",")) if ns.stage != "all" else {"copy", "equiv", "b1", "profile", "tput"}
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    bw = copy_bandwidth() if "copy" in stages else 4.2
    fine = tuple(range(256, 784, 16)) + (1024, 4096)
    if "gemm" in stages:
        gemm_sweep(fine)
    if "gemmfp8" in stages:
        gemm_sweep(fine, fp8=True)
    if "sampler" in stages:
        sampler_timing()
    if "equiv" in stages:
        greedy_equivalence()
    if "smollm2" in stages:
        smollm2_equivalence(ns.gguf)
    if "peer1b" in stages:
        from kiln.runtime import LLM
        small = LLM(model="builtin:llama-3.2-1b", load_format="dummy", dtype="bfloat16", max_num_seqs=256,
                    max_num_batched_tokens=8192, max_model_len=2048, kv_cache_memory_fraction=0.5)
        throughput(small, 256, 128, 128, 256)
        del small
        torch.cuda.empty_cache()
    if stages & {"b1", "profile", "steps", "tput", "tput8b", "fixed8b", "runprof", "runlog"}:
        t0 = time.perf_counter()
        llm = llama8b(max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.budget, max_model_len=4096)
        log(f"[load] llama-3.1-8b dummy bf16 ready in {time.perf_counter()-t0:.0f}s, "
            f"{llm.engine.runner.num_kv_blocks} KV blocks, max_num_seqs {ns.max_num_seqs}")
        if "b1" in stages:
            batch1_decode(llm, bw)
        if "profile" in stages:
            profile_decode(llm)
        if "steps" in stages:
            profile_steps(llm, 1, 128)
            profile_steps(llm, 256, 1500)
        if "runprof" in stages:
            run_profile(llm)
        if "runlog" in stages:
            run_profile(llm, prof_at=None, tag=f"_b{ns.budget}_s{ns.max_num_seqs}")
        if "tput8b" in stages:
            throughput(llm, 1000, 1000, 1000, None)
        if "fixed8b" in stages:
            throughput(llm, 512, 128, 128, None)
            throughput(llm, 256, 2048, 128, None)
        if "tput" in stages:
            if ns.quick:
                throughput(llm, 256, 128, 128, None if ns.skip_peer else 64)
            else:
                throughput(llm, 1000, 1000, 1000, None if ns.skip_peer else 200)
                throughput(llm, 512, 128, 128, None)
                throughput(llm, 256, 2048, 128, None)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if "fp8tput" in stages:
        fp8_throughput(ns.max_num_seqs, kv_fraction=ns.kv_fraction, budget=ns.budget)
    if "fp8pick" in stages:
        pick_fp8_decode(ns.fp8kv_max_num_seqs)
    if "fp8kvtput" in stages:
        fp8_throughput(ns.fp8kv_max_num_seqs, fp8_kv=True, kv_fraction=ns.kv_fraction, budget=ns.budget)
    if "peer8b" in stages:
        # Kiln and transformers' continuous batching on the same subset of the 1000/1000
        # workload; a smaller KV pool leaves room for the peer's copy of the weights.
        llm = llama8b(max_num_seqs=ns.peer_n, max_num_batched_tokens=ns.budget, max_model_len=4096,
                      kv_cache_memory_fraction=0.45)
        throughput(llm, ns.peer_n, 1000, 1000, ns.peer_n)
        del llm
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_results.json"), "w") as f:
            json.dump(RESULTS, f, indent=2, default=str)
    log("==== summary ====")
    for k, v in RESULTS.items():
        log(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
