"""W4A16 GEMM against its torch reference (CPU: Triton interpreter, float16/float32; GPU: also
bfloat16 and real Llama-3.1-8B shapes).  Also checks the runtime's packer and the kernel's
reference agree on the format."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, HAS_CUDA, rel_err

from kiln.kernels.w4a16 import dequantize_ref, w4a16_gemm, w4a16_ref

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_weight(N: int, K: int, G: int, device=DEVICE, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), generator=g, dtype=torch.int64).to(torch.int32)
    # (random bits: any int32 is a valid packed word, in either nibble order)
    scales = (torch.rand(K // G, N, generator=g) * 0.02 + 0.001).half()
    qzeros = torch.randint(0, 16, (K // G, N), generator=g, dtype=torch.int64).to(torch.uint8)
    return qweight.to(device), scales.to(device), qzeros.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,G", [(1, 64, 128, 32), (3, 96, 256, 64), (16, 40, 192, 64), (17, 64, 128, 128),
                                     (33, 80, 384, 128), (2, 32, 576, 64), (4, 24, 640, 128)])
def test_matches_reference(dtype, M, N, K, G):
    qw, s, z = make_weight(N, K, G)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    out = w4a16_gemm(x, qw, s, z)
    ref = w4a16_ref(x, qw, s, z)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("kernel", ["gemv", "mma"])
@pytest.mark.parametrize("split,bk,G", [(1, 64, 64), (2, 64, 128), (3, 128, 128), (4, 128, 32), (2, 128, 64)])
def test_kernels_split_k_and_strided_input(kernel, split, bk, G):
    """Both kernels, per-group (G >= BLOCK_K) and per-weight (G < BLOCK_K) scale paths; split-K
    partial sums add up in one launch; a non-contiguous x is read correctly."""
    if kernel == "mma" and bk < 128:
        pytest.skip("the mma kernel needs BLOCK_K >= 128")
    M, N, K = 5, 48, 640
    qw, s, z = make_weight(N, K, G, seed=1)
    big = torch.randn(M, 2 * K, device=DEVICE)
    x = big[:, ::2]
    bm = 2 if kernel == "gemv" else 16
    cfg = {"KERNEL": kernel, "BLOCK_M": bm, "BLOCK_N": 16, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 1,
           "num_stages": 1}
    out = w4a16_gemm(x, qw, s, z, config=cfg)
    assert rel_err(out, w4a16_ref(x.contiguous(), qw, s, z)) < 1e-5
    again = w4a16_gemm(x, qw, s, z, config=cfg)  # the split counters were left at zero
    assert torch.equal(out, again)


def test_format_matches_runtime_packer():
    """kiln.runtime's pack() and this module's dequantize_ref agree bit for bit."""
    from kiln.runtime.quantization import int4

    N, K, G = 24, 64, 32
    w = torch.randn(N, K)
    s, z = int4.quantize_params(w, G)
    q = int4.quantize_with(w, s, z, G)
    packed = int4.pack(q, s, z)
    assert torch.equal(int4.unpack(packed["qweight"]), q)
    ref = dequantize_ref(packed["qweight"], packed["scales"], packed["qzeros"])
    assert torch.allclose(ref, int4.dequantize(packed["qweight"], packed["scales"], packed["qzeros"]), atol=0, rtol=0)
    assert (ref - w).abs().max() <= s.max() * 0.5 + 1e-6
    assert packed["scales"].dtype == torch.float16 and torch.equal(packed["scales"].float(), s.t())


def test_interleaved_layout():
    """Bits 4i..4i+3 of packed row 8b + r hold column 64b + 8i + r."""
    from kiln.runtime.quantization import int4

    N, K = 3, 128
    q = (torch.arange(K) % 16).repeat(N, 1).to(torch.int32)
    q[1] = torch.randint(0, 16, (K,), generator=torch.Generator().manual_seed(0))
    qw = int4.pack(q, torch.ones(N, 1), torch.zeros(N, 1))["qweight"]
    for b, r, i in [(0, 0, 0), (0, 3, 5), (1, 7, 7), (1, 2, 1)]:
        assert (int(qw[8 * b + r, 1]) >> (4 * i)) & 0xF == int(q[1, 64 * b + 8 * i + r])
    assert torch.equal(int4.unpack(qw), q)


def test_bad_shapes():
    qw, s, z = make_weight(32, 128, 32)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_gemm(torch.randn(2, 64, device=DEVICE), qw, s, z)
    with pytest.raises(ValueError, match="qweight"):  # K not a multiple of 64
        w4a16_gemm(torch.randn(2, 96, device=DEVICE), *make_weight(32, 96, 32)[:1], s[:3], z[:3])
    with pytest.raises(ValueError, match="2-D"):
        w4a16_gemm(torch.randn(2, 2, 128, device=DEVICE), qw, s, z)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 4, 16, 128])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_llama8b_shapes_bf16(M, N, K):
    qw, s, z = make_weight(N, K, 128)
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    assert rel_err(w4a16_gemm(x, qw, s, z), w4a16_ref(x, qw, s, z)) < 1e-2


@pytest.mark.skipif(not HAS_CUDA, reason="float8 in Triton's CPU interpreter is not supported; GPU only")
@pytest.mark.parametrize("T,K", [(1, 4096), (7, 576), (1024, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_token_quant_fp8(T, K, dtype):
    from kiln.kernels.fp8_quant import per_token_quant_fp8, per_token_quant_fp8_ref

    x = (torch.randn(T, K, device="cuda") * 3).to(dtype)
    x[0, 5] = 300.0
    q, s = per_token_quant_fp8(x)
    qr, sr = per_token_quant_fp8_ref(x)
    assert torch.allclose(s, sr, rtol=1e-6, atol=0)
    deq, deqr = q.float() * s, qr.float() * sr
    assert rel_err(deq, deqr) < 1e-2 and rel_err(deq, x.float()) < 0.05
