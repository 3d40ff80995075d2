"""rms_norm / fused_add_rms_norm (Triton) against their references."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, ELEMENTWISE_TOL, EXACT_TOL, FLOAT_DTYPES, poison
from kiln.kernels import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

ULP_TOL = ELEMENTWISE_TOL


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T,H", [(1, 1), (3, 7), (5, 96), (4, 1000)])
def test_rms_norm(T, H, dtype):
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    w = torch.randn(H, device=DEVICE).to(dtype)
    out = poison(torch.empty_like(x))
    rms_norm(x, w, 1e-6, out=out)
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), **ULP_TOL[dtype])


def test_rms_norm_strided_rows_and_float32_weight():
    x = torch.randn(6, 200, device=DEVICE, dtype=torch.float16)[:, :130]
    w = torch.randn(130, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **ULP_TOL[torch.float16])


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T,H", [(1, 33), (7, 512)])
def test_fused_add_rms_norm(T, H, dtype, inplace):
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    r = torch.randn(T, H, device=DEVICE).to(dtype)
    w = torch.randn(H, device=DEVICE).to(dtype)
    ref_n, ref_r = fused_add_rms_norm_ref(x, r, w, 1e-5)
    x_in, r_in = x.clone(), r.clone()
    normed, res = fused_add_rms_norm(x_in, r_in, w, 1e-5, inplace=inplace)
    torch.testing.assert_close(res, ref_r, **EXACT_TOL[dtype])
    torch.testing.assert_close(normed, ref_n, **ULP_TOL[dtype])
    if inplace:
        assert normed.data_ptr() == x_in.data_ptr() and res.data_ptr() == r_in.data_ptr()
    else:
        assert torch.equal(x_in, x) and torch.equal(r_in, r)


def test_rejects_bad_arguments():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError):
        rms_norm(x.t(), torch.ones(3, device=DEVICE), 1e-6)
    with pytest.raises(ValueError):
        fused_add_rms_norm(x, x.half(), torch.ones(8, device=DEVICE), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [4096, 8192])
def test_gpu_real_size(H):
    x = torch.randn(4096, H, device=DEVICE, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(H, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **ULP_TOL[torch.bfloat16])
    n, res = fused_add_rms_norm(x, r, w, 1e-5)
    rn, rr = fused_add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(res, rr, **EXACT_TOL[torch.bfloat16])
    torch.testing.assert_close(n, rn, **ULP_TOL[torch.bfloat16])
