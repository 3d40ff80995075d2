"""Programmatic dependent launch (``kiln.kernels.pdl``): when it is used, and that every kernel
launched with it waits for its predecessor before touching global memory (offline sm_90 SASS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.kernels.options import KernelOptions
from kiln.kernels.pdl import launch_kwargs, pdl_enabled

_ROOT = Path(__file__).resolve().parents[2]


def test_launch_kwargs_off_on_cpu_and_when_disabled(monkeypatch):
    assert launch_kwargs(torch.device("cpu")) == {"PDL": False}
    assert not pdl_enabled(torch.device("cpu"))
    assert launch_kwargs(torch.device("cuda"), KernelOptions(pdl=False)) == {"PDL": False}  # before any CUDA call
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch_kwargs(torch.device("cuda")) == {"PDL": False}  # the interpreter has no griddepcontrol


def test_every_pdl_kernel_waits_before_global_memory():
    """Compile each kernel for sm_90 with PDL on: ``griddepcontrol.wait`` (ACQBULK) must come
    before the first global load/store and before ``launch_dependents`` (PREEXIT); with PDL
    off, neither instruction is there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT / "kernels"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(_ROOT / "benchmarks" / "pdl_sass_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    kernels = [k for k in out if not k.endswith(":off")]
    assert len(kernels) >= 16, kernels
    assert out["w4a16_gemv2_prefetch"]["loads_before_wait"] == 0, out["w4a16_gemv2_prefetch"]
    for name in kernels:
        r = out[name]
        assert r["wait"] >= 0, f"{name}: no griddepcontrol.wait with PDL on: {r}"
        assert r["first_global"] > r["wait"], f"{name}: global memory touched before the PDL wait: {r}"
        assert r["trigger"] > r["wait"], f"{name}: launch_dependents before the wait: {r}"
    for name in ("rms_norm:off", "w4a16_gemv2:off"):
        assert out[name]["wait"] == -1 and out[name]["trigger"] == -1, out[name]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="needs a Hopper GPU")
def test_pdl_chain_in_cuda_graph_matches_ordinary_launches(monkeypatch):
    """A decode-like chain (add+RMSNorm -> W4A16 GEMV -> SiLU-and-mul -> bf16 GEMV) captured in
    a CUDA graph gives the same result with PDL on as with ordinary launches."""
    from kiln.kernels.activation import silu_and_mul
    from kiln.kernels.gemv import gemv
    from kiln.kernels.norm import fused_add_rms_norm
    from kiln.kernels.w4a16 import w4a16_gemm

    torch.manual_seed(0)
    K, N = 1024, 2048
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    nw = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
    qw = torch.randint(-2**31, 2**31 - 1, (K // 8, 2 * N), dtype=torch.int32, device="cuda")
    sc = torch.rand(K // 128, 2 * N, device="cuda", dtype=torch.float16) * 0.01
    qz = torch.randint(0, 16, (K // 128, 2 * N), dtype=torch.uint8, device="cuda")
    w2 = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * 0.02
    cfg = {"KERNEL": "gemv2", "BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 256, "CHAIN": 8, "SPLIT_K": 2,
           "num_warps": 4, "num_stages": 2}  # split-K: partials and counters written after the wait

    outs = {}
    for flag in ("0", "1"):
        opts = KernelOptions(pdl=flag == "1")

        def step():
            h, _ = fused_add_rms_norm(x, res, nw, 1e-5, options=opts)
            return gemv(silu_and_mul(w4a16_gemm(h, qw, sc, qz, cfg, options=opts), options=opts), w2, options=opts)

        step()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = step()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        outs[flag] = y.float().clone()
    torch.testing.assert_close(outs["1"], outs["0"], rtol=1e-3, atol=1e-3)
