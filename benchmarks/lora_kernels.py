"""Batched LoRA kernels at a decode step's sizes: time of shrink + expand per target linear
of the Llama-3.1-8B shape against the base matmul of the same linear, and the bytes bound of
the LoRA pair (adapter weights and activations read once, output read and written once).

Usage (repository root, on the GPU machine)::

    PYTHONPATH=common:runtime:kernels python3 benchmarks/lora_kernels.py [--tokens 256] [--slots 4] [--rank 16]

Times are CUDA-graph replays (launch overhead as the engine's decode graphs see it), the
median of 20 replays of 50 calls each.  Prints one line per linear and the sum over the
model's 32 layers.
"""

from __future__ import annotations

import argparse

import torch

from kiln.kernels.lora import lora_expand, lora_segments, lora_shrink

# (name, K, part widths) of the 8B shape's target linears
LINEARS = [("qkv_proj", 4096, [4096, 1024, 1024]), ("o_proj", 4096, [4096]),
           ("gate_up_proj", 4096, [14336, 14336]), ("down_proj", 14336, [4096])]


def graph_time_us(fn, calls: int = 50, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="HBM bandwidth for the bound (H200: 4.8 TB/s)")
    ns = ap.parse_args()
    T, S, R, dt = ns.tokens, ns.slots, ns.rank, torch.bfloat16
    dev = torch.device("cuda")
    slots = (torch.arange(T, device=dev) % S).to(torch.int32)
    ids, counts, starts = lora_segments(slots, S)
    tot_lora = tot_base = tot_bound = 0.0
    print(f"{torch.cuda.get_device_name()}: T={T} tokens, {S} adapters (uniform), rank {R}, bf16")
    for name, K, parts in LINEARS:
        N, P = sum(parts), len(parts)
        x = torch.randn(T, K, device=dev, dtype=dt)
        w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
        a = torch.randn(S, P * R, K, device=dev, dtype=dt) / K**0.5
        b = torch.randn(S, N, R, device=dev, dtype=dt) * 0.01
        y = torch.empty(T, N, device=dev, dtype=dt)
        h = torch.empty(T, P * R, device=dev, dtype=torch.float32)

        def base():
            torch.matmul(x, w.T, out=y)

        def lora():
            lora_shrink(x, a, ids, counts, starts, out=h)
            lora_expand(y, h, b, ids, counts, starts, part_sizes=parts)

        t_base, t_lora = graph_time_us(base), graph_time_us(lora)
        bytes_ = (a.numel() + b.numel() + x.numel() + 2 * y.numel()) * 2 + 2 * h.numel() * 4
        bound = bytes_ / (ns.bandwidth_gbs * 1e9) * 1e6
        tot_lora, tot_base, tot_bound = tot_lora + t_lora, tot_base + t_base, tot_bound + bound
        print(f"{name:13s} K={K:6d} N={N:6d}  base {t_base:8.1f} us  lora {t_lora:7.1f} us "
              f"({100 * t_lora / t_base:5.1f}% of base)  bound {bound:6.1f} us ({100 * bound / t_lora:5.1f}% of it)")
    L = ns.layers
    print(f"per step over {L} layers: base linears {tot_base * L / 1000:.2f} ms, lora {tot_lora * L / 1000:.2f} ms "
          f"(bound {tot_bound * L / 1000:.2f} ms)")


if __name__ == "__main__":
    main()
