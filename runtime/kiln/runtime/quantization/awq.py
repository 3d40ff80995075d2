"""``int4-awq``: AWQ, activation-aware weight quantization, W4A16.

AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", MLSys 2024): a few input channels carry large activations, and the weights
that multiply them matter most.  Scaling those weight columns up by ``s`` before rounding (and
the activations down by ``s``, folded into the previous operation) shrinks their relative
rounding error.  AWQ searches ``s = mean|x|^r`` (normalized) over a grid ``r in [0, 1)`` for
the value that minimizes the layer's output error on calibration tokens (also in the
reference's "duo" form that divides by the weights' mean normalized magnitude),

    r* = argmin_r || X W^T - (X / s) Q(W * s)^T ||^2,

then searches a per-group clipping range of the scaled weights (``max|w|`` shrunk by up to
50%, symmetric as in the reference, or the ``[min, max]`` range shrunk proportionally) the same
way, and rounds with the chosen ranges.  Folds: RMSNorm weights before QKV and gate-up,
up-projection rows before down, value rows before the output projection when heads are not
grouped (under GQA the output projection is only range-searched, as in the reference
implementation).  Q/K rows keep plain min/max ranges, as in the reference (searching them too
measured worse on SmolLM2-135M: +12.2% instead of +10.0% perplexity).

Storage and kernel: ``quantization.int4`` (group size 128 default; 32 and 64 allowed).
"""

from __future__ import annotations

import torch

from . import int4
from .base import QuantHandler, check_group_size
from .int4 import Int4LinearMethod, store_int4

N_GRID = 20  # grid points of the scale exponent r
CLIP_GRID = 20  # clipping thresholds max * (1 - i / CLIP_GRID)
MAX_SHRINK = 0.5  # smallest threshold: half the group's max
CLIP_TOKENS = 256  # calibration rows used by the clip search
CLIP_CHUNK = 1024  # output rows per clip-search chunk (bounds memory)


def search_scale(x: torch.Tensor, x_absmean: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ's scale search for one input shared by the rows of ``w``.

    Candidates (the reference implementation's two families): ``s = mean|x|^r`` and the
    "duo" form ``s = mean|x|^r / mean|w_hat|^(1-r)`` (``w_hat``: weights normalized by their
    group's max), ``r = i / 20``, each normalized by ``sqrt(max s * min s)``; ``r = 0`` of the
    first family is plain rounding, so the result is never worse than it on the calibration rows.

    Args:
        x: float32 [S, K] calibration rows of the input.
        x_absmean: float32 [K] mean |x| per channel over all calibration tokens.
        w: float32 [N, K] weights of every linear that reads ``x``.
    Returns:
        float32 [K] scales.
    """
    N, K = w.shape
    wg = w.abs().reshape(N, K // group_size, group_size)
    w_mean = (wg / wg.amax(dim=2, keepdim=True).clamp(min=1e-8)).reshape(N, K).mean(dim=0)
    ref = x @ w.t()
    best, best_s = float("inf"), torch.ones_like(x_absmean)
    xm = x_absmean.clamp(min=1e-4)
    for duo in (False, True):
        for i in range(N_GRID):
            r = i / N_GRID
            s = (xm.pow(r) / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4) if duo else xm.pow(r)
            s = s / (s.max() * s.min()).sqrt()
            wq = int4.fake_quantize(w * s, group_size) / s
            loss = (ref - x @ wq.t()).pow(2).mean().item()
            if loss < best:
                best, best_s = loss, s
    return best_s


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's clipping search, per output row and group: the quantization range whose rounded
    group product ``x_g . Q(w_g)`` is closest to ``x_g . w_g`` on calibration rows.  Candidates:
    the reference's symmetric clamps ``|w| <= max|w| * (1 - i/20)`` (i < 10) and proportional
    shrinks of the asymmetric range ``[min, max] * (1 - i/20)``; ``i = 0`` is plain min/max.

    Args:
        x: float32 [S, K] calibration rows (already divided by the AWQ scales).
        w: float32 [N, K] (already multiplied by the scales).
    Returns:
        scales, zeros float32 [N, K // G] for ``int4.quantize_with``.
    """
    N, K = w.shape
    ng = K // group_size
    xg = x[:CLIP_TOKENS].reshape(-1, ng, group_size)  # [S, ng, G]
    out_s = torch.empty(N, ng, device=w.device)
    out_z = torch.empty(N, ng, device=w.device)
    for n0 in range(0, N, CLIP_CHUNK):
        wg = w[n0:n0 + CLIP_CHUNK].reshape(-1, ng, group_size)  # [n, ng, G]
        ref = torch.einsum("sgk,ngk->sng", xg, wg)
        wmax = wg.amax(dim=-1).clamp(min=0)
        wmin = wg.amin(dim=-1).clamp(max=0)
        amax = torch.maximum(wmax, -wmin)
        best_s = torch.zeros_like(wmax)
        best_z = torch.zeros_like(wmax)
        min_err = torch.full(wmax.shape, float("inf"), device=w.device)
        for i in range(int(MAX_SHRINK * CLIP_GRID)):
            f = 1 - i / CLIP_GRID
            for hi, lo in ((torch.minimum(wmax, amax * f), torch.maximum(wmin, -amax * f)), (wmax * f, wmin * f)):
                s = ((hi - lo) / 15).clamp(min=1e-7, max=65504.0).to(int4.SCALE_DTYPE).float()  # as stored
                z = torch.round(-lo / s).clamp(0, 15)
                q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, 15)
                deq = (q - z[..., None]) * s[..., None]
                err = (torch.einsum("sgk,ngk->sng", xg, deq) - ref).pow(2).mean(dim=0)  # [n, ng]
                better = err < min_err
                min_err = torch.where(better, err, min_err)
                best_s = torch.where(better, s, best_s)
                best_z = torch.where(better, z, best_z)
        out_s[n0:n0 + CLIP_CHUNK] = best_s
        out_z[n0:n0 + CLIP_CHUNK] = best_z
    return out_s, out_z


class AwqHandler(QuantHandler):
    needs_calibration = True
    wants = frozenset({"absmean", "samples"})

    def check(self, model) -> None:
        check_group_size(model, self.settings.group_size)

    def quantize_layer(self, layer, prefix, stats) -> None:
        G = self.settings.group_size
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gu, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        xs: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            # 1. scale search and folds (all before any rounding)
            st = stats["self_attn.qkv_proj"]
            s = search_scale(st.samples, st.absmean, qkv.weight.float(), G)
            qkv.weight.mul_(s)
            layer.input_layernorm.weight.div_(s)
            xs["qkv"] = st.samples / s

            st = stats["self_attn.o_proj"]
            q_size, kv_size = attn.q_size, attn.kv_size
            if q_size == kv_size:  # no GQA: fold into the value rows
                s = search_scale(st.samples, st.absmean, o.weight.float(), G)
                o.weight.mul_(s)
                qkv.weight[q_size + kv_size:].div_(s[:, None])
                if qkv.bias is not None:
                    qkv.bias[q_size + kv_size:].div_(s)
                xs["o"] = st.samples / s
            else:
                xs["o"] = st.samples

            st = stats["mlp.gate_up_proj"]
            s = search_scale(st.samples, st.absmean, gu.weight.float(), G)
            gu.weight.mul_(s)
            layer.post_attention_layernorm.weight.div_(s)
            xs["gu"] = st.samples / s

            st = stats["mlp.down_proj"]
            s = search_scale(st.samples, st.absmean, down.weight.float(), G)
            down.weight.mul_(s)
            inter = gu.weight.shape[0] // 2
            gu.weight[inter:].div_(s[:, None])
            xs["down"] = st.samples / s

            # 2. clipping (range) search, then rounding with the chosen ranges
            w = qkv.weight.float()
            qk = q_size + kv_size
            s_qk, z_qk = int4.quantize_params(w[:qk], G)  # Q/K rows: plain min/max (as the reference)
            s_v, z_v = search_clip(xs["qkv"], w[qk:], G)
            sc, zr = torch.cat([s_qk, s_v]), torch.cat([z_qk, z_v])
            store_int4(qkv, int4.quantize_with(w, sc, zr, G), sc, zr, G)
            for key, mod in (("o", o), ("gu", gu), ("down", down)):
                w = mod.weight.float()
                sc, zr = search_clip(xs[key], w, G)
                store_int4(mod, int4.quantize_with(w, sc, zr, G), sc, zr, G)

    def quantize_lm_head(self, model, stats) -> None:
        """AWQ on the LM head: the scale search on its inputs (the final norm's outputs), the
        scales folded into the final norm's weight (the head is that norm's only reader), then
        the clipping search.  The head's weight is read, never written: a tied embedding
        keeps its float table."""
        G = self.settings.group_size
        head, norm = model.lm_head, model.model.norm
        with torch.no_grad():
            w = head.weight.float()
            s = search_scale(stats.samples, stats.absmean, w, G)
            w = w * s
            norm.weight.div_(s.to(norm.weight.dtype))
            sc, zr = search_clip(stats.samples / s, w, G)
            store_int4(head, int4.quantize_with(w, sc, zr, G), sc, zr, G)
