"""GPU measurements of the quantized paths (H200, Llama-3.1-8B shapes, random weights).

``python -m kiln.runtime.quantization.gpu_bench [--skip-decode] --json OUT``

1. W4A16 GEMM (``kiln.kernels.w4a16``) vs bf16 cuBLAS (``x @ W.T``) at M = 1..16 on the
   8B projection shapes.  Both timed inside one CUDA graph that cycles through enough weight
   copies (>= 512 MB) that nothing is served from the 60 MB L2; time per GEMM.
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

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


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


def bench_w4a16(ms=(1, 2, 4, 8, 16)) -> list[dict]:
    from kiln.kernels.w4a16 import TUNED, w4a16_gemm

    from . import int4

    rows = []
    for name, (N, K) in SHAPES.items():
        copies = max(2, (512 << 20) // (N * K * 2))
        w = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        s, z = int4.quantize_params(w[0].float(), 128)
        packed = int4.pack(int4.quantize_with(w[0].float(), s, z, 128), s, z)
        q = [{k: v.clone() for k, v in packed.items()} for _ in range(max(2, (512 << 20) // (N * K // 2)))]
        best = None
        x16 = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
        for bn in (64, 128):
            for split in (1, 2, 4, 8):
                for warps, stages in ((4, 3), (8, 3)):
                    cfg = {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": split, "num_warps": warps,
                           "num_stages": stages}
                    try:
                        t = graph_time([lambda p=p, c=cfg: w4a16_gemm(x16, p["qweight"], p["scales"], p["qzeros"], c)
                                        for p in q[:8]], reps=5)
                    except Exception as e:  # noqa: BLE001 - resources exceeded etc.
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
        TUNED[(N, K, 16)] = best[1]
        print(json.dumps({"shape": name, "tuned_M16": best[1], "us": best[0] * 1e6}), flush=True)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_bf16 = graph_time([lambda wi=wi: x @ wi.t() for wi in w])
            t_w4 = graph_time([lambda p=p: w4a16_gemm(x, p["qweight"], p["scales"], p["qzeros"]) for p in q])
            rows.append({"shape": name, "N": N, "K": K, "M": M, "bf16_us": t_bf16 * 1e6, "w4a16_us": t_w4 * 1e6,
                         "speedup": t_bf16 / t_w4, "w4a16_GBps": (N * K / 2 + N * K // 128 * 5) / t_w4 / 1e9,
                         "config": TUNED[(N, K, 16)]})
            print(json.dumps(rows[-1]), flush=True)
        del w, q
    return rows


def bench_fp8(ms=(1024, 4096, 8192)) -> list[dict]:
    from triton.testing import do_bench

    from .fp8 import quantize_rows_fp8

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

            from kiln.kernels.fp8_quant import per_token_quant_fp8

            def full():
                a, sa = per_token_quant_fp8(x)
                return torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=ws, out_dtype=torch.bfloat16)

            t_full = do_bench(full, warmup=10, rep=50)
            fl = 2 * M * N * K
            rows.append({"shape": name, "M": M, "N": N, "K": K, "bf16_TFLOPs": fl / t_bf16 / 1e9,
                         "fp8_mm_TFLOPs": fl / t_mm / 1e9, "fp8_with_act_quant_TFLOPs": fl / t_full / 1e9,
                         "speedup_mm": t_bf16 / t_mm, "speedup_with_act_quant": t_bf16 / t_full})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _quantize_dummy(model, method: str, group_size: int = 128) -> None:
    """Quantize a dummy-weight model in place on the GPU (speed only: RTN for int4)."""
    from . import int4
    from .base import decoder_linears
    from .fp8 import Fp8Handler

    for layer in model.model.layers:
        if method == "fp8":
            Fp8Handler(None).quantize_layer(layer, "", None)
            continue
        for _, mod in decoder_linears(layer):
            w = mod.weight.data.float()
            s, z = int4.quantize_params(w, group_size)
            int4.store_int4(mod, int4.quantize_with(w, s, z, group_size), s, z, group_size)
    torch.cuda.empty_cache()


def bench_decode(methods=("bf16", "int4", "fp8"), new_tokens: int = 128) -> list[dict]:
    from ..llm import LLM
    from ..model_runner import ModelRunner
    from ..sampling_params import SamplingParams

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
            if _m != "bf16":
                _quantize_dummy(self.model, _m)

        ModelRunner.init_dummy_weights = patched
        try:
            t0 = time.perf_counter()
            llm = LLM(model="builtin:llama-3.1-8b", load_format="dummy", max_num_seqs=8, num_kv_blocks=512,
                      max_model_len=1024)
            load_s = time.perf_counter() - t0
            sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
            prompt = [list(range(1000, 1032))]
            llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = llm.generate(prompt, sp)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            n = len(out[0].outputs[0].token_ids)
            rows.append({"method": method, "batch": 1, "new_tokens": n, "tok_s": n / wall, "ms_per_token": wall / n * 1e3,
                         "load_s": load_s, "weights_GiB": torch.cuda.memory_allocated() / 2**30})
            print(json.dumps(rows[-1]), flush=True)
            del llm
            torch.cuda.empty_cache()
        finally:
            ModelRunner.init_dummy_weights = orig
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--only", default="w4a16,fp8,decode")
    a = p.parse_args()
    only = set(a.only.split(","))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "w4a16" in only:
        res["w4a16"] = bench_w4a16()
    if "fp8" in only:
        res["fp8"] = bench_fp8()
    if "decode" in only and not a.skip_decode:
        res["decode"] = bench_decode()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
