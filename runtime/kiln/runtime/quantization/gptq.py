"""``int4-gptq``: GPTQ, Hessian-based error compensation, W4A16 (AWQ's storage and kernel).

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023) quantizes a layer's weight columns one at a time and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian
of the layer's reconstruction loss ``||X W^T - X Q^T||^2`` (``H = 2 X^T X / n``, from
calibration tokens):

    err = (w_k - q_k) / [H^-1]_kk ;   W[:, k+1:] -= err * [H^-1]_{k, k+1:}

using the upper Cholesky factor of ``H^-1`` (the paper's numerically stable form), lazy
block updates of 128 columns, and a dampening of 1% of ``mean(diag H)``.  Options of the
reference implementation used here: act-order (columns by descending ``diag H``) with static
groups (scale and zero point fixed per group before the sweep, chosen by a range-shrinking
MSE search), so the stored format is exactly AWQ's (``quantization.int4``), groups contiguous;
and "true sequential" (the linears of a layer in the order QKV, output, gate-up, down, each
Hessian collected with the earlier ones already quantized: 17.045 instead of 17.127 perplexity
on SmolLM2-135M at group 64, with float32 scales).  The column sweep (``gptq_sweep``) takes the number format as a
callback; ``fp8.gptq_fp8`` runs it with the E4M3 grid.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import int4
from .base import TRUE_SEQUENTIAL, QuantHandler, check_group_size, decoder_linears
from .int4 import Int4LinearMethod, store_int4

DAMP = 0.01  # fraction of mean(diag H) added to the diagonal
BLOCK = 128  # columns per lazy-update block
MSE_GRID, MSE_MAX_SHRINK, MSE_NORM = 100, 0.8, 2.4  # GPTQ reference quantizer's mse search


def mse_group_params(w: torch.Tensor, group_size: int, grid: int = MSE_GRID, max_shrink: float = MSE_MAX_SHRINK,
                     norm: float = MSE_NORM) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group asymmetric 4-bit parameters that minimize ``sum |w - Q(w)|^norm`` over shrunk
    ranges ``[min * p, max * p]``, ``p = 1 - i / grid`` (GPTQ's quantizer with ``mse=True``).

    Args:
        w: float [N, K].
    Returns:
        scales, zeros: float32 [N, K // G].
    """
    N, K = w.shape
    g = w.float().reshape(N, K // group_size, group_size)
    wmax = g.amax(dim=2).clamp(min=0)
    wmin = g.amin(dim=2).clamp(max=0)
    best_err = torch.full(wmax.shape, float("inf"), device=w.device)
    best_s = torch.zeros_like(wmax)
    best_z = torch.zeros_like(wmax)
    for i in range(int(max_shrink * grid)):
        p = 1 - i / grid
        s = ((wmax - wmin) * p / 15).clamp(min=1e-7, max=65504.0).to(int4.SCALE_DTYPE).float()  # as stored
        z = torch.round(-wmin * p / s).clamp(0, 15)
        q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, 15)
        err = ((q - z[..., None]) * s[..., None] - g).abs().pow(norm).sum(dim=2)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_z = torch.where(better, z, best_z)
    return best_s, best_z


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1`` (float32 [K, K]),
    retrying with 10x the dampening up to four times.

    Raises:
        RuntimeError: the dampened Hessian is still not positive definite.
    """
    H = hessian.double()
    K = H.shape[0]
    mean_diag = torch.mean(torch.diag(H))
    for attempt in range(5):
        Hd = H + (damp * 10**attempt) * mean_diag * torch.eye(K, dtype=H.dtype, device=H.device)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()
    raise RuntimeError("GPTQ: the calibration Hessian is not positive definite even after dampening")


def gptq_sweep(w: torch.Tensor, hessian: torch.Tensor,
               quantize_column: Callable[[torch.Tensor, int], torch.Tensor],
               damp: float = DAMP, act_order: bool = True) -> torch.Tensor:
    """GPTQ's column sweep for any element-wise quantizer (the number format is the callback's).

    Columns are visited in descending ``diag(H)`` order ("act-order") or in natural order;
    each column is rounded by ``quantize_column`` and its error spread over the columns not
    yet visited through the inverse Hessian's upper Cholesky factor, with lazy block updates
    of ``BLOCK`` columns (Frantar et al., Algorithm 1).  Inputs that never fire
    (``H[k, k] == 0``) get zero weights.

    Args:
        w: float [N, K].
        hessian: float [K, K], ``2/n * X^T X`` of the layer's calibration inputs.
        quantize_column: ``(column float32 [N], k) -> dequantized column float32 [N]``, ``k``
            the column's index in the original order (for per-group parameters).
        damp: relative dampening.
        act_order: visit columns by descending ``diag(H)``.
    Returns:
        float32 [N, K] dequantized weights in the original column order (every entry a value
        of the callback's grid).
    Raises:
        RuntimeError: the dampened Hessian is still not positive definite after retries.
    """
    W = w.float().clone()
    N, K = W.shape
    H = hessian.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(K, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    hinv = inverse_hessian_factor(H, damp)
    Q = torch.zeros(N, K, dtype=torch.float32, device=W.device)
    order = perm.tolist()
    for i1 in range(0, K, BLOCK):
        i2 = min(i1 + BLOCK, K)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        Hb = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            q = quantize_column(W1[:, i], order[i1 + i])
            Q[:, i1 + i] = q
            err = (W1[:, i] - q) / Hb[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hb[i, i:].unsqueeze(0)
            E1[:, i] = err
        W[:, i2:] -= E1 @ hinv[i1:i2, i2:]
    return Q[:, torch.argsort(perm)].contiguous()


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = DAMP,
                  act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w`` [N, K] to int4 with GPTQ.

    Group parameters are fixed up front from the weights (``mse_group_params``: "static
    groups"), so columns can be visited in descending ``diag(H)`` order ("act-order": the
    columns with the largest input energy are rounded first, while the most columns remain to
    absorb their error) and the stored groups are still contiguous in the original order.

    Args:
        w: float [N, K].
        hessian: float [K, K], ``2/n * X^T X`` of the layer's calibration inputs.
        group_size: columns per group (divides K).
        damp: relative dampening.
        act_order: visit columns by descending ``diag(H)``.
    Returns:
        (codes int32 [N, K], scales float32 [N, K // G], zeros float32 [N, K // G]).
    Raises:
        RuntimeError: the dampened Hessian is still not positive definite after retries.
    """
    W = w.float().clone()
    W[:, torch.diag(hessian) == 0] = 0
    scales, zeros = mse_group_params(W, group_size)
    col_s = scales.repeat_interleave(group_size, dim=1)  # [N, K]
    col_z = zeros.repeat_interleave(group_size, dim=1)

    def int4_column(c: torch.Tensor, k: int) -> torch.Tensor:
        s, z = col_s[:, k], col_z[:, k]
        return (torch.clamp(torch.round(c / s) + z, 0, 15) - z) * s

    deq = gptq_sweep(W, hessian, int4_column, damp, act_order)
    return int4.quantize_with(deq, scales, zeros, group_size), scales, zeros


class GptqHandler(QuantHandler):
    needs_calibration = True
    wants = frozenset({"hessian"})

    sequential_groups = TRUE_SEQUENTIAL  # the reference's "true sequential"

    def check(self, model) -> None:
        check_group_size(model, self.settings.group_size)

    def quantize_layer(self, layer, prefix, stats) -> None:
        G = self.settings.group_size
        damp = float(self.settings.extra.get("damp", DAMP))
        with torch.no_grad():
            for name, mod in decoder_linears(layer):
                if name not in stats:
                    continue  # another sequential group
                q, s, z = gptq_quantize(mod.weight.float(), stats[name].hessian, G, damp)
                store_int4(mod, q, s, z, G)

    def quantize_lm_head(self, model, stats) -> None:
        """GPTQ on the LM head's weight with the Hessian of its inputs (the final norm's
        outputs); a tied embedding keeps its float table."""
        G = self.settings.group_size
        damp = float(self.settings.extra.get("damp", DAMP))
        head = model.lm_head
        with torch.no_grad():
            q, s, z = gptq_quantize(head.weight.float(), stats.hessian, G, damp)
            store_int4(head, q, s, z, G)
