"""The time bound of each FP8 offline workload of the Llama-3.1-8B shape on one H200, from
measured rates (no GPU needed): GEMM FLOPs over the FP8 GEMM rate, prefill attention FLOPs
over the prefill attention rate, decode attention's KV bytes over the copy bandwidth.  Prints
the serial bound (the three one after the other) and the bound with attention overlapped with
the GEMMs, and each published / measured rate's share of the serial bound.

    python3 benchmarks/fp8_bounds.py [--gemm-tflops 1150] [--prefill-attn-tflops 227] [--copy-tbs 4.26]

Defaults: the H200 rates in docs/benchmarks.md (FP8 ``torch._scaled_mm`` with the activation
quantization at M >= 4096; prefill attention over a bf16 cache; copy bandwidth).
"""

from __future__ import annotations

import argparse

HIDDEN, LAYERS, VOCAB, KV_HEADS, HEAD_DIM, HEADS = 4096, 32, 128256, 8, 128, 32
INTERMEDIATE, QKV = 14336, 6144
# (name, requests, prompt tokens, output tokens, Kiln FP8 tok/s, TensorRT-LLM FP8 tok/s);
# the tok/s as the FP8 performance issue records them (Kiln measured 2026-12-02, TRT-LLM published)
WORKLOADS = (("1000 x 1000/1000", 1000, 1000, 1000, 13_421, 17_744),
             ("4,096 x 128/128", 4096, 128, 128, 23_768, 27_911),
             ("1,000 x 2048/128", 1000, 2048, 128, 2_925, 3_538))


def bounds(requests: int, prompt: int, output: int, gemm: float, attn: float, copy: float) -> dict:
    """Seconds of each part (``gemm``, ``attn``: FLOP/s; ``copy``: bytes/s)."""
    layer = HIDDEN * QKV + HIDDEN * HIDDEN + HIDDEN * 2 * INTERMEDIATE + INTERMEDIATE * HIDDEN
    weights, lm_head = layer * LAYERS, VOCAB * HIDDEN
    p, o = requests * prompt, requests * output
    gemm_flop = p * 2 * weights + o * 2 * (weights + lm_head)  # prompt rows skip the LM head
    attn_flop = p * 4 * (prompt / 2) * HEADS * HEAD_DIM * LAYERS  # causal: mean context prompt / 2
    kv_fp8 = LAYERS * KV_HEADS * HEAD_DIM * 2  # bytes per context token, K and V, FP8
    kv_bytes = o * (prompt + output / 2) * kv_fp8  # each output token reads its whole context
    out = {"gemm_pflop": gemm_flop / 1e15, "gemm_s": gemm_flop / gemm, "attn_pflop": attn_flop / 1e15,
           "attn_s": attn_flop / attn, "kv_tb": kv_bytes / 1e12, "decode_s": kv_bytes / copy,
           "decode_bf16_s": 2 * kv_bytes / copy}
    out["serial_tok_s"] = o / (out["gemm_s"] + out["attn_s"] + out["decode_s"])
    out["overlap_tok_s"] = o / max(out["gemm_s"] + out["attn_s"], out["decode_s"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm-tflops", type=float, default=1150.0)
    ap.add_argument("--prefill-attn-tflops", type=float, default=227.0)
    ap.add_argument("--copy-tbs", type=float, default=4.26)
    a = ap.parse_args()
    print("| workload | GEMMs | prefill attention | decode attention, FP8 KV (bf16 KV) | bound, serial "
          "| bound, overlapped | Kiln FP8 (of serial) | TensorRT-LLM FP8 (of serial) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, p, o, kiln, trt in WORKLOADS:
        b = bounds(n, p, o, a.gemm_tflops * 1e12, a.prefill_attn_tflops * 1e12, a.copy_tbs * 1e12)
        print(f"| {name} | {b['gemm_pflop']:.1f} PFLOP, {b['gemm_s']:.1f} s | {b['attn_pflop']:.2f} PFLOP, "
              f"{b['attn_s']:.1f} s | {b['kv_tb']:.1f} TB, {b['decode_s']:.1f} s ({b['decode_bf16_s']:.1f} s) | "
              f"{b['serial_tok_s']:,.0f} tok/s | {b['overlap_tok_s']:,.0f} tok/s | {kiln:,} "
              f"({kiln / b['serial_tok_s']:.0%}) | {trt:,} ({trt / b['serial_tok_s']:.0%}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
