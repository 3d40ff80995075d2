"""``int4-gptq``: GPTQ, Hessian-based error compensation, W4A16 (AWQ's storage and kernel).

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023) quantizes a layer's weight columns one at a time and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian
of the layer's reconstruction loss ``||X W^T - X Q^T||^2`` (``H = 2 X^T X / n``, from
calibration tokens):

    err = (w_k - q_k) / [H^-1]_kk ;   W[:, k+1:] -= err * [H^-1]_{k, k+1:}

using the upper Cholesky factor of ``H^-1`` (the paper's numerically stable form), lazy
block updates of 128 columns, and a dampening of 1% of ``mean(diag H)``.  Group parameters
(scale, zero point) are taken when the sweep reaches each group's first column, from the
error-updated weights, so the stored format is exactly AWQ's (``quantization.int4``).
Columns are processed in their natural order (no act-order), so groups stay contiguous.
"""

from __future__ import annotations

import torch

from . import int4
from .base import QuantHandler, check_group_size, register
from .int4 import Int4LinearMethod, store_int4

DAMP = 0.01  # fraction of mean(diag H) added to the diagonal
BLOCK = 128  # columns per lazy-update block (a multiple of every allowed group size)


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = DAMP
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w`` [N, K] to int4 with GPTQ.

    Args:
        w: float [N, K].
        hessian: float [K, K], ``2/n * X^T X`` of the layer's calibration inputs.
        group_size: columns per group (divides K).
        damp: relative dampening.
    Returns:
        (codes int32 [N, K], scales float32 [N, K // G], zeros float32 [N, K // G]).
    Raises:
        RuntimeError: the dampened Hessian is still not positive definite after retries.
    """
    W = w.float().clone()
    N, K = W.shape
    H = hessian.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    hinv = None
    mean_diag = torch.mean(torch.diag(H))
    for attempt in range(5):
        Hd = H + (damp * 10**attempt) * mean_diag * torch.eye(K, dtype=H.dtype, device=H.device)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()
            break
    if hinv is None:
        raise RuntimeError("GPTQ: the calibration Hessian is not positive definite even after dampening")
    Q = torch.zeros(N, K, dtype=torch.int32, device=W.device)
    ng = K // group_size
    scales = torch.zeros(N, ng, device=W.device)
    zeros = torch.zeros(N, ng, device=W.device)
    block = max(BLOCK // group_size, 1) * group_size
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        Hb = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                s, z = int4.quantize_params(W1[:, i:i + group_size], group_size)
                scales[:, col // group_size] = s[:, 0]
                zeros[:, col // group_size] = z[:, 0]
            g = col // group_size
            s, z = scales[:, g], zeros[:, g]
            q = torch.clamp(torch.round(W1[:, i] / s) + z, 0, 15)
            Q[:, col] = q.to(torch.int32)
            err = (W1[:, i] - (q - z) * s) / Hb[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hb[i, i:].unsqueeze(0)
            E1[:, i] = err
        W[:, i2:] -= E1 @ hinv[i1:i2, i2:]
    return Q, scales, zeros


class GptqHandler(QuantHandler):
    needs_calibration = True
    wants = frozenset({"hessian"})

    def check(self, model) -> None:
        check_group_size(model, self.settings.group_size)

    def quantize_layer(self, layer, prefix, stats) -> None:
        G = self.settings.group_size
        damp = float(self.settings.extra.get("damp", DAMP))
        with torch.no_grad():
            for name, mod in (("self_attn.qkv_proj", layer.self_attn.qkv_proj),
                              ("self_attn.o_proj", layer.self_attn.o_proj),
                              ("mlp.gate_up_proj", layer.mlp.gate_up_proj),
                              ("mlp.down_proj", layer.mlp.down_proj)):
                q, s, z = gptq_quantize(mod.weight.float(), stats[name].hessian, G, damp)
                store_int4(mod, q, s, z, G)


register("int4-gptq", GptqHandler, lambda settings, name: Int4LinearMethod(settings.group_size))
