"""silu_and_mul (Triton) against silu_and_mul_ref."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, ELEMENTWISE_TOL, EXACT_TOL, FLOAT_DTYPES, poison
from kiln.kernels import silu_and_mul, silu_and_mul_ref

TOL = ELEMENTWISE_TOL


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 1), (3, 7), (5, 300)])
def test_silu_and_mul(T, inter, dtype):
    x = (torch.randn(T, 2 * inter, device=DEVICE) * 4).to(dtype)
    out = poison(torch.empty(T, inter, device=DEVICE, dtype=dtype))
    silu_and_mul(x, out=out)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[dtype])


def test_strided_rows():
    x = torch.randn(4, 100, device=DEVICE)[:, :60]
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[torch.float32])


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(2, 8, device=DEVICE), out=torch.empty(2, 3, device=DEVICE))


@pytest.mark.gpu
def test_gpu_real_size():
    x = torch.randn(4096, 2 * 14336, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[torch.bfloat16])
