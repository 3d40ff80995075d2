"""W4A16 GEMM against its torch reference (CPU: Triton interpreter, float16/float32; GPU: also
bfloat16 and real Llama-3.1-8B shapes).  Also checks the runtime's packer and the kernel's
reference agree on the format, and the packed-half GEMV (``gemv2``): its f16x2 bit tricks in
numpy, its fallback path (the interpreter runs the same lanes as the inline PTX) on every
group size, M <= 4, chain length, split-K and ragged shape."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, HAS_CUDA, rel_err

import numpy as np

from kiln.kernels.activation import silu_and_mul
from kiln.kernels.w4a16 import choose_config, dequantize_ref, w4a16_gemm, w4a16_ref


def to_kmajor(t: torch.Tensor) -> torch.Tensor:
    """The same ``[R, N]`` values stored column by column (strides ``(1, R)``): every kernel
    reads the packed tensors through their strides."""
    return t.t().contiguous().t()

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


@pytest.mark.parametrize("kernel,bm,split", [("gemv2", 1, 1), ("gemv2", 2, 2), ("gemv", 2, 1), ("mma", 16, 2),
                                             ("dequant", 16, 1)])
def test_float32_output(kernel, bm, split):
    """``out_dtype=torch.float32`` (a quantized LM head's logits): every kernel stores its float32
    accumulators unrounded, equal to the reference to float32 precision, not x's dtype's."""
    if kernel == "dequant" and not HAS_CUDA:
        pytest.skip("the dequant path's kernel runs on CUDA (cuBLAS after it)")
    M, N, K, G = min(bm, 2) + 1 if kernel == "mma" else bm, 96, 256, 64
    qw, s, z = make_weight(N, K, G, seed=3)
    x = torch.randn(M, K, device=DEVICE).half()
    cfg = {"KERNEL": kernel, "BLOCK_M": bm, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": split, "num_warps": 1,
           "num_stages": 1, "CHAIN": 8}
    out = w4a16_gemm(x, qw, s, z, config=cfg, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (M, N)
    ref = w4a16_ref(x.float(), qw, s, z)  # float32 math and result
    half = w4a16_gemm(x, qw, s, z, config=cfg)
    assert half.dtype == torch.float16
    # gemv2 rounds products to float16 (its documented ~1e-3), mma and dequant the weights (~1e-4);
    # the float32 GEMV is exact, so there the float32 output must beat the float16 one
    assert rel_err(out, ref) < {"gemv": 1e-5, "mma": 1e-3}.get(kernel, 2e-3)
    assert kernel != "gemv" or rel_err(out, ref) < rel_err(half, ref) / 10
    with pytest.raises(ValueError, match="out_dtype"):
        w4a16_gemm(x, qw, s, z, out_dtype=torch.int32)


def _swiglu_ref(x, qw, s, z):
    y = w4a16_ref(x.float(), qw, s, z)
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("M,I,K,G,bn,prefetch,dtype", [(1, 48, 256, 64, 32, 0, torch.float16),
                                                       (2, 72, 128, 32, 16, 1, torch.bfloat16),
                                                       (3, 40, 192, 64, 32, 0, torch.float16)])
def test_gemv2_fused_silu_and_mul(monkeypatch, M, I, K, G, bn, prefetch, dtype):
    """``silu_and_mul=True`` on a gate|up weight [2I, K]: the gemv2 epilogue (no K split) gives
    silu(gate) * up of the reference (I not a multiple of the half tile: masked columns), and
    equals the unfused path (GEMM, then ``activation.silu_and_mul``) up to one rounding; a K split
    takes the unfused path."""
    qw, s, z = make_weight(2 * I, K, G, seed=5)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    cfg = {"KERNEL": "gemv2", "BLOCK_M": min(4, 1 << (M - 1).bit_length()), "BLOCK_N": bn, "BLOCK_K": 128,
           "SPLIT_K": 1, "num_warps": 1, "num_stages": 1, "CHAIN": 8, "PREFETCH": prefetch}
    ref = _swiglu_ref(x, qw, s, z)
    fused = w4a16_gemm(x, qw, s, z, config=cfg, silu_and_mul=True)
    assert fused.shape == (M, I) and fused.dtype == dtype
    assert rel_err(fused, ref) < (3e-3 if dtype == torch.float16 else 1e-2)
    unfused = silu_and_mul(w4a16_gemm(x, qw, s, z, config=cfg))
    assert rel_err(unfused, ref) < 1e-2 and rel_err(fused, unfused) < 1e-2
    split = w4a16_gemm(x, qw, s, z, config=dict(cfg, SPLIT_K=2), silu_and_mul=True)
    assert rel_err(split, ref) < 1e-2
    with pytest.raises(ValueError, match="even N"):
        w4a16_gemm(x, qw[:, :-1], s[:, :-1], z[:, :-1], config=cfg, silu_and_mul=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2])
def test_gemv2_fused_silu_llama8b_gate_up(M):
    """The fused SwiGLU epilogue at the Llama-3.1-8B gate_up shape with its TUNED config."""
    qw, s, z = make_weight(28672, 4096, 128)
    x = torch.randn(M, 4096, device=DEVICE, dtype=torch.bfloat16)
    assert rel_err(w4a16_gemm(x, qw, s, z, silu_and_mul=True), _swiglu_ref(x, qw, s, z)) < 1e-2


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


def test_f16x2_magic_numbers():
    """The lane arithmetic of ``_h2_dequant`` (numpy float16): LOP3 of a packed word with
    0x000F000F / 0x00F000F0 and 0x64006400 gives (1024 + q, ...) / (1024 + 16 q, ...); one FMA
    with 1/16 (1/256) and the zero-point word gives (q - z) / 16 exactly; nibbles t, t + 4 share
    a word (low, high lane)."""
    from kiln.kernels.w4a16 import jit as W

    rng = np.random.default_rng(0)
    p = rng.integers(0, 2**32, 512, dtype=np.uint64).astype(np.uint32)
    z_lo, z_hi = rng.integers(0, 16, 512).astype(np.uint32), rng.integers(0, 16, 512).astype(np.uint32)
    zz = z_lo | (z_hi << 16)
    zc1 = zz | np.uint32(W._H2_ZC1.value & 0xFFFFFFFF)
    zc2 = (zz << 4) | np.uint32(W._H2_ZC2.value & 0xFFFFFFFF)

    def lanes(w):  # uint32 -> float64 [n, 2] (low, high)
        return w.astype("<u4").view(np.float16).reshape(-1, 2).astype(np.float64)

    def fma(a, b, c):  # exact product and sum, one float16 rounding (as fma.rn.f16x2)
        return (lanes(a) * lanes(np.full_like(a, b)) + lanes(c)).astype(np.float16).astype(np.float64)

    t = p >> 8
    words = [fma((p & 0x000F000F) | 0x64006400, 0x2C002C00, zc1), fma((p & 0x00F000F0) | 0x64006400, 0x1C001C00, zc2),
             fma((t & 0x000F000F) | 0x64006400, 0x2C002C00, zc1), fma((t & 0x00F000F0) | 0x64006400, 0x1C001C00, zc2)]
    for i in range(4):
        q_lo, q_hi = (p >> (4 * i)) & 0xF, (p >> (4 * i + 16)) & 0xF
        np.testing.assert_array_equal(words[i][:, 0] * 16, q_lo.astype(np.float64) - z_lo)
        np.testing.assert_array_equal(words[i][:, 1] * 16, q_hi.astype(np.float64) - z_hi)


GEMV2_TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,G,bn,bk,split,chain", [
    (1, 64, 256, 32, 16, 128, 1, 8), (1, 48, 640, 128, 32, 256, 2, 8), (2, 40, 384, 64, 16, 128, 3, 4),
    (3, 24, 320, 32, 16, 128, 2, 8), (4, 16, 512, 128, 16, 64, 4, 4), (1, 80, 1024, 64, 32, 128, 4, 8),
])
def test_gemv2_matches_reference(dtype, M, N, K, G, bn, bk, split, chain, prefetch):
    """The packed-half GEMV against the float32 reference: every group size (32: the two lanes of
    a word in different groups), M = 1..4 (BLOCK_M 1, 2, 4 with masked rows), K and N not
    multiples of the tile, split-K, both chain lengths, both x dtypes, with and without the
    next step's loads prefetched (``PREFETCH``; a split's last step re-reads itself).  A wrong nibble order or
    a missing zero point gives an error of order 1."""
    qw, s, z = make_weight(N, K, G, seed=M + K)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    cfg = {"KERNEL": "gemv2", "BLOCK_M": min(4, 1 << (M - 1).bit_length()), "BLOCK_N": bn, "BLOCK_K": bk,
           "CHAIN": chain, "SPLIT_K": split, "num_warps": 1, "num_stages": 1, "PREFETCH": prefetch}
    ref = x.float() @ dequantize_ref(qw, s, z).t()
    out = w4a16_gemm(x, qw, s, z, config=cfg)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out, ref) < GEMV2_TOL[dtype]
    assert torch.equal(out, w4a16_gemm(x, qw, s, z, config=cfg))  # split counters back at zero


def test_gemv2_strided_x_and_choice():
    """A non-contiguous x is copied to the int64-word view; float32 x goes through float16;
    ``choose_config`` picks gemv2 for float16/bfloat16 at M <= 2 and G % 32 == 0 only."""
    N, K, G = 32, 256, 64
    qw, s, z = make_weight(N, K, G, seed=3)
    big = torch.randn(2, 2 * K, device=DEVICE).half()
    x = big[:, ::2]
    cfg = {"KERNEL": "gemv2", "BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 1,
           "num_stages": 1}
    ref = x.float() @ dequantize_ref(qw, s, z).t()
    assert rel_err(w4a16_gemm(x, qw, s, z, config=cfg), ref) < GEMV2_TOL[torch.float16]
    assert rel_err(w4a16_gemm(x.float(), qw, s, z, config=cfg), ref) < GEMV2_TOL[torch.float16]
    dev = torch.device("cpu")
    assert choose_config(1, N, K, G, dev, torch.bfloat16)["KERNEL"] == "gemv2"
    assert choose_config(2, N, K, G, dev, torch.float16)["KERNEL"] == "gemv2"
    assert choose_config(1, N, K, G, dev, torch.float32)["KERNEL"] == "gemv"
    assert choose_config(1, N, K, 16, dev, torch.float16)["KERNEL"] == "gemv"
    assert choose_config(4, N, K, G, dev, torch.float16, kernel="gemv2")["BLOCK_M"] == 4
    assert choose_config(2, N, K, G, dev, torch.float16, kernel="gemv")["KERNEL"] == "gemv"
    with pytest.raises(ValueError, match="gemv or gemv2"):
        choose_config(2, N, K, G, dev, torch.float16, kernel="gemm")
    with pytest.raises(ValueError, match="gemv2"):
        w4a16_gemm(x, *make_weight(N, K, 16, seed=3), config=cfg)


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
@pytest.mark.parametrize("M", [1, 4, 16, 63, 64, 128, 600])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_llama8b_shapes_bf16(M, N, K):
    qw, s, z = make_weight(N, K, 128)
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    assert rel_err(w4a16_gemm(x, qw, s, z), w4a16_ref(x, qw, s, z)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("N,K,G", [(6144, 4096, 128), (4096, 14336, 128), (4096, 4096, 32)])
def test_llama8b_shapes_gemv2_inline_ptx(M, N, K, G):
    """The inline-PTX path of gemv2 (the CPU runs only its fallback) on real shapes, bf16 and fp16."""
    qw, s, z = make_weight(N, K, G)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(M, K, device=DEVICE, dtype=dtype)
        cfg = choose_config(M, N, K, G, x.device, dtype, kernel="gemv2")
        assert cfg["KERNEL"] == "gemv2"
        ref = x.float() @ dequantize_ref(qw, s, z).t()
        assert rel_err(w4a16_gemm(x, qw, s, z, config=cfg), ref) < GEMV2_TOL[dtype]


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
    # a shard of wider rows: the rows' max given (a row-parallel rank's all-reduced max)
    amax = x.float().abs().amax(dim=-1, keepdim=True) * 3
    q, s = per_token_quant_fp8(x, amax)
    qr, sr = per_token_quant_fp8_ref(x, amax)
    assert torch.allclose(s, sr, rtol=1e-6, atol=0) and torch.allclose(s, amax / 448, rtol=1e-6, atol=0)
    assert rel_err(q.float() * s, qr.float() * sr) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_tuned_configs_every_group_size(M, N, K, G):
    """What the runtime launches (``TUNED`` for the Llama-3.1-8B shapes, measured at group 128)
    is right at every group size it may meet."""
    qw, s, z = make_weight(N, K, G)
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    assert rel_err(w4a16_gemm(x, qw, s, z), w4a16_ref(x, qw, s, z)) < GEMV2_TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("G", [32, 128])
@pytest.mark.parametrize("M", [1, 2])
def test_tuned_lm_head_float32_logits(M, G):
    """The quantized LM head's launch (``TUNED`` at 128256 x 4096, M = 1) with float32 logits."""
    qw, s, z = make_weight(128256, 4096, G)
    x = torch.randn(M, 4096, device=DEVICE, dtype=torch.bfloat16)
    out = w4a16_gemm(x, qw, s, z, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, w4a16_ref(x.float(), qw, s, z)) < GEMV2_TOL[torch.float16]


SWAP_DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])  # the interpreter has no bfloat16 dot


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("dtype", SWAP_DTYPES)
@pytest.mark.parametrize("M,N,K,G,bk,bm,split", [
    (1, 48, 256, 128, 128, 8, 1),     # one row of x, one group per step
    (5, 40, 640, 64, 64, 8, 3),       # N not a multiple of BLOCK_N, split-K over 10 steps
    (16, 64, 192, 64, 64, 16, 2),     # a full 16-row tile
    (19, 32, 256, 128, 128, 16, 1),   # two row tiles
])
def test_swap_kernel_matches_reference(dtype, M, N, K, G, bk, bm, split, prefetch):
    """The swap-AB tensor-core kernel (weight as the A operand, code pairs in x's dtype, dot K
    order permuted within each block of 64; x, scales and zero points loaded in the step or one
    step ahead) against the float32 reference, with a strided x;
    repeated calls give the same bits (split-K counters back at zero)."""
    qw, s, z = make_weight(N, K, G, seed=7)
    x = torch.randn(M, 2 * K, device=DEVICE).to(dtype)[:, ::2]
    cfg = {"KERNEL": "swap", "BLOCK_M": bm, "BLOCK_N": 16, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 1,
           "num_stages": 1, "PREFETCH": prefetch}
    out = w4a16_gemm(x, qw, s, z, config=cfg)
    ref = w4a16_ref(x.contiguous(), qw, s, z)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(out, w4a16_gemm(x, qw, s, z, config=cfg))


def test_swap_kernel_refuses_what_it_cannot_do():
    qw, s, z = make_weight(32, 256, 64)
    cfg = {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 1,
           "num_stages": 1}
    with pytest.raises(ValueError, match="G % BLOCK_K"):  # a group smaller than the step
        w4a16_gemm(torch.randn(2, 256, device=DEVICE).half(), qw, s, z, config=cfg)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        w4a16_gemm(torch.randn(2, 256, device=DEVICE), qw, s, z, config=dict(cfg, BLOCK_K=64))
    with pytest.raises(ValueError, match="KERNEL must be"):  # a misspelt kernel is not run as another one
        w4a16_gemm(torch.randn(2, 256, device=DEVICE).half(), qw, s, z, config=dict(cfg, KERNEL="swapp"))


@pytest.mark.parametrize("N,K,G,bn,bk", [(40, 256, 32, 16, 128), (64, 640, 128, 32, 512), (24, 384, 64, 64, 256)])
def test_dequantize_kernel_and_large_m_path(N, K, G, bn, bk):
    """``w4a16.dequant.dequantize`` equals the torch reference bit for bit in float32 (one
    rounding, ``(q - z) * s``) with ragged N and K tiles, on N- and K-major buffers; the
    ``dequant`` kernel config (what ``choose_config`` picks on CUDA from ``DEQUANT_MIN_M``) is
    the reference GEMM; smaller M keeps the fused kernels."""
    from kiln.kernels import w4a16
    from kiln.kernels.w4a16.dequant import dequantize

    qw, s, z = make_weight(N, K, G, seed=N)
    ref = dequantize_ref(qw, s, z)
    assert torch.equal(dequantize(qw, s, z, torch.float32, bn, bk, 1), ref)
    assert torch.equal(dequantize(to_kmajor(qw), to_kmajor(s), to_kmajor(z), torch.float32, bn, bk, 1), ref)
    assert torch.equal(dequantize(qw, s, z, torch.float16, bn, bk, 1), ref.half())
    x = torch.randn(5, K, device=DEVICE)
    cfg = {"KERNEL": "dequant", "BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": 1,
           "num_stages": 1}
    assert rel_err(w4a16_gemm(x, qw, s, z, config=cfg), x @ ref.t()) < 1e-6
    cuda = torch.device("cuda")
    assert choose_config(w4a16.DEQUANT_MIN_M, 4096, 4096, 128, cuda, torch.bfloat16)["KERNEL"] == "dequant"
    if HAS_CUDA:  # (the fused-kernel defaults read the GPU's SM count)
        assert choose_config(w4a16.DEQUANT_MIN_M - 1, 4096, 4096, 128, cuda, torch.bfloat16)["KERNEL"] == "mma"
    assert choose_config(4096, 4096, 4096, 128, torch.device("cpu"), torch.bfloat16)["KERNEL"] == "mma"


@pytest.mark.parametrize("kernel", ["gemv", "gemv2", "mma", "swap"])
def test_k_major_packed_words(kernel):
    """Every kernel reads the packed words through their strides: a K-major copy (``qweight`` a
    [K/8, N] view of an [N, K/8] tensor) gives the same result as the N-major original."""
    M, N, K, G = 3, 48, 256, 64
    qw, s, z = make_weight(N, K, G, seed=11)
    qk = qw.t().contiguous().t()
    assert qk.stride() == (1, K // 8) and torch.equal(qk, qw)
    x = torch.randn(M, K, device=DEVICE).half()
    bm = {"gemv": 4, "gemv2": 4, "mma": 16, "swap": 8}[kernel]
    cfg = {"KERNEL": kernel, "BLOCK_M": bm, "BLOCK_N": 16, "BLOCK_K": 64 if kernel == "swap" else 128,
           "SPLIT_K": 2, "num_warps": 1, "num_stages": 1, "CHAIN": 8, "PREFETCH": 1}
    assert torch.equal(w4a16_gemm(x, qk, s, z, config=cfg), w4a16_gemm(x, qw, s, z, config=cfg))
    # scales and zero points K-major too
    assert torch.equal(w4a16_gemm(x, qk, to_kmajor(s), to_kmajor(z), config=cfg),
                       w4a16_gemm(x, qw, s, z, config=cfg))
    assert rel_err(w4a16_gemm(x, qk, s, z, config=cfg), w4a16_ref(x, qw, s, z)) < GEMV2_TOL[torch.float16]


def test_bad_configs_and_operands():
    """Launch configs and operands that do not fit get a ValueError, not a ZeroDivisionError,
    KeyError, interpreter error or a silently wrong result."""
    qw, s, z = make_weight(32, 256, 64)
    x = torch.randn(2, 256, device=DEVICE).half()
    cfg = {"KERNEL": "swap", "BLOCK_M": 8, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 1,
           "num_stages": 1}
    for key, value in [("BLOCK_K", 0), ("BLOCK_N", 0), ("BLOCK_M", 0), ("BLOCK_N", 24), ("BLOCK_K", -64),
                       ("SPLIT_K", 0), ("SPLIT_K", -3), ("num_stages", 0), ("num_warps", 3), ("BLOCK_N", 16.0)]:
        with pytest.raises(ValueError, match=key):
            w4a16_gemm(x, qw, s, z, config=dict(cfg, **{key: value}))
    with pytest.raises(ValueError, match="lacks num_stages"):
        w4a16_gemm(x, qw, s, z, config={k: v for k, v in cfg.items() if k != "num_stages"})
    with pytest.raises(ValueError, match="must be a dict"):
        w4a16_gemm(x, qw, s, z, config=[cfg])
    with pytest.raises(ValueError, match="scales must be"):
        w4a16_gemm(x, qw, s.to(torch.int32), z)
    with pytest.raises(ValueError, match="qzeros uint8"):
        w4a16_gemm(x, qw, s, z.to(torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        w4a16_gemm(x, qw, s[0], z)
    with pytest.raises(ValueError, match="empty weight"):
        w4a16_gemm(torch.zeros(2, 0, device=DEVICE).half(), torch.zeros(0, 32, dtype=torch.int32, device=DEVICE),
                   torch.zeros(0, 32, device=DEVICE).half(), torch.zeros(0, 32, dtype=torch.uint8, device=DEVICE))


def test_split_k_sums_partials_in_split_order():
    """The last split to arrive adds all partials in split order (not its own first), so the
    result does not depend on which split finishes last: it equals ``((p0 + p1) + p2) + p3`` of
    the four K slices computed separately, bit for bit (float32 x and output: no rounding
    between the partials and the sum)."""
    M, N, K, G, split = 2, 32, 512, 64, 4
    ks = K // split
    qw, sc, qz = make_weight(N, K, G, seed=3)
    torch.manual_seed(3)
    x = torch.randn(M, K, dtype=torch.float32, device=DEVICE)
    cfg = {"KERNEL": "gemv", "BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": split, "num_warps": 1,
           "num_stages": 1}
    y = w4a16_gemm(x, qw, sc, qz, cfg)
    parts = [w4a16_gemm(x[:, s * ks:(s + 1) * ks], qw[s * ks // 8:(s + 1) * ks // 8], sc[s * ks // G:(s + 1) * ks // G],
                        qz[s * ks // G:(s + 1) * ks // G], dict(cfg, SPLIT_K=1)) for s in range(split)]
    expect = parts[0]
    for p in parts[1:]:
        expect = expect + p
    assert torch.equal(y, expect)
