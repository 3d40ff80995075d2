"""Small-M GEMV against a float64 reference (CPU: Triton interpreter, all three dtypes; GPU: also
the Llama-3.1-8B shapes, the LM head and a CUDA-graph capture)."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, HAS_CUDA, rel_err

from kiln.kernels.gemv import MAX_M, TUNED, choose_config, gemv, gemv_ref, m_bucket, use_gemv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def ref64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def make(M: int, N: int, K: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype).to(DEVICE)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 7, 37), (2, 33, 130), (3, 16, 64), (4, 100, 300), (5, 9, 257),
                                   (6, 40, 128), (7, 3, 1000), (8, 64, 512)])
def test_matches_reference(dtype, M, N, K):
    x, w = make(M, N, K, dtype)
    out = gemv(x, w)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out, ref64(x, w)) < TOL[dtype]


@pytest.mark.parametrize("split", [1, 2, 3, 5])
@pytest.mark.parametrize("bm,bn,bk", [(1, 4, 64), (2, 8, 32), (4, 1, 128), (8, 2, 64)])
def test_configs_split_k(split, bm, bn, bk):
    """Any tile and split: rows past M and N clamped and dropped, a ragged last K chunk masked,
    split-K partials added in the same launch and the counters left at zero."""
    M, N, K = 6, 21, 451
    x, w = make(M, N, K, torch.float32, seed=split)
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 1, "num_stages": 1}
    out = gemv(x, w, config=cfg)
    assert rel_err(out, ref64(x, w)) < TOL[torch.float32]
    assert torch.equal(out, gemv(x, w, config=cfg))


def test_even_k_split():
    x, w = make(3, 10, 512, torch.float16)
    cfg = {"BLOCK_M": 4, "BLOCK_N": 4, "BLOCK_K": 64, "SPLIT_K": 4, "num_warps": 1, "num_stages": 1}
    assert rel_err(gemv(x, w, config=cfg), ref64(x, w)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_output_and_strided_x(dtype):
    """out_dtype=float32 (the LM head's logits); x rows with a stride, and x with a column stride."""
    M, N, K = 3, 24, 200
    big = torch.randn(M, 2 * K, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) * 0.05).to(dtype)
    for x in (big[:, :K], big[:, ::2]):
        out = gemv(x, w, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        assert rel_err(out, ref64(x, w)) < 1e-5
        assert torch.equal(gemv_ref(x, w, torch.float32), (x.float() @ w.float().t()))


def test_empty():
    x, w = make(2, 5, 16, torch.float32)
    assert gemv(x[:0], w).shape == (0, 5)
    assert torch.equal(gemv(x[:, :0], w[:, :0]), torch.zeros(2, 5, device=DEVICE))


def test_bad_inputs():
    x, w = make(2, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv(x, w[:, :32])
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv(x[None], w)
    with pytest.raises(ValueError, match="dtype"):
        gemv(x.half(), w)
    with pytest.raises(ValueError, match="dtype"):
        gemv(x.double(), w.double())
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="out_dtype"):
        gemv(x, w, out_dtype=torch.int32)


def test_config_table():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 0]
    assert not use_gemv(MAX_M + 1, 4096, 4096)
    for (N, K, mb), cfg in TUNED.items():
        assert mb in (1, 2, 4, 8) and cfg["BLOCK_M"] <= MAX_M
        assert cfg["BLOCK_K"] % (256 * cfg["num_warps"]) == 0  # no layout conversion in the loop
        assert use_gemv(mb, N, K)
    assert use_gemv(1, 6144, 4096) and use_gemv(1, 128256, 4096)  # the 8B decode shapes at M = 1
    assert not use_gemv(4, 6144, 4096) and not use_gemv(1, 4096, 4097)
    cfg = choose_config(1, 4096, 4096, torch.device("cuda"))
    assert set(cfg) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"}


LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("N,K", LLAMA8B)
def test_llama8b_shapes_bf16(M, N, K):
    x, w = make(M, N, K, torch.bfloat16)
    ref = ref64(x, w)
    out = gemv(x, w, out_dtype=torch.float32 if N == 128256 else None)
    assert rel_err(out, ref) < (1e-5 if N == 128256 else 1e-2)
    assert torch.equal(out, gemv(x, w, out_dtype=out.dtype))  # deterministic, split counters reset


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_graph_capture():
    """Captured once, replayed with new inputs (split-K partials from the graph's pool)."""
    x, w = make(1, 4096, 4096, torch.bfloat16)
    cfg = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1}
    gemv(x, w, config=cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = gemv(x, w, config=cfg)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(y, ref64(x, w)) < 1e-2
