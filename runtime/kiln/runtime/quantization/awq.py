"""``int4-awq``: AWQ, activation-aware weight quantization, W4A16.

AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", MLSys 2024): a few input channels carry large activations, and the weights
that multiply them matter most.  Scaling those weight columns up by ``s`` before rounding (and
the activations down by ``s``, folded into the previous operation) shrinks their relative
rounding error.  AWQ searches ``s = mean|x|^r`` (normalized) over a grid ``r in [0, 1)`` for
the value that minimizes the layer's output error on calibration tokens,

    r* = argmin_r || X W^T - (X / s) Q(W * s)^T ||^2,

then searches a per-group clipping threshold of the scaled weights (``max|w|`` shrunk by up
to 50%) the same way.  Folds: RMSNorm weights before QKV and gate-up, up-projection rows
before down, value rows before the output projection when heads are not grouped (under GQA
the output projection is only clipped, as in the reference implementation).  Q/K rows are
not clipped (the reference skips them: the softmax is sensitive to them).

Storage and kernel: ``quantization.int4`` (group size 128 default; 32 and 64 allowed).
"""

from __future__ import annotations

import torch

from . import int4
from .base import QuantHandler, check_group_size, register
from .int4 import Int4LinearMethod, store_int4

N_GRID = 20  # grid points of the scale exponent r
CLIP_GRID = 20  # clipping thresholds max * (1 - i / CLIP_GRID)
MAX_SHRINK = 0.5  # smallest threshold: half the group's max
CLIP_TOKENS = 256  # calibration rows used by the clip search
CLIP_CHUNK = 1024  # output rows per clip-search chunk (bounds memory)


def search_scale(x: torch.Tensor, x_absmean: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ's scale search for one input shared by the rows of ``w``.

    Args:
        x: float32 [S, K] calibration rows of the input.
        x_absmean: float32 [K] mean |x| per channel over all calibration tokens.
        w: float32 [N, K] weights of every linear that reads ``x``.
    Returns:
        float32 [K] scales (all ones when no ratio beats plain rounding).
    """
    ref = x @ w.t()
    best, best_s = float("inf"), torch.ones_like(x_absmean)
    for i in range(N_GRID):
        r = i / N_GRID
        s = x_absmean.clamp(min=1e-4).pow(r)
        s = s / (s.max() * s.min()).sqrt()
        wq = int4.fake_quantize(w * s, group_size) / s
        loss = (ref - x @ wq.t()).pow(2).mean().item()
        if loss < best:
            best, best_s = loss, s
    return best_s


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ's clipping search: per output row and group, the threshold ``max|w| * (1 - i/20)``
    (i < 10) whose quantized group product ``x_g . Q(clip(w_g))`` is closest to ``x_g . w_g``.

    Args:
        x: float32 [S, K] calibration rows (already divided by the AWQ scales).
        w: float32 [N, K] (already multiplied by the scales).
    Returns:
        the clipped weights float32 [N, K].
    """
    N, K = w.shape
    ng = K // group_size
    xg = x[:CLIP_TOKENS].reshape(-1, ng, group_size)  # [S, ng, G]
    out = torch.empty_like(w)
    for n0 in range(0, N, CLIP_CHUNK):
        wg = w[n0:n0 + CLIP_CHUNK].reshape(-1, ng, group_size)  # [n, ng, G]
        ref = torch.einsum("sgk,ngk->sng", xg, wg)
        org_max = wg.abs().amax(dim=-1, keepdim=True)
        best_max = org_max.clone()
        min_err = torch.full(wg.shape[:2], float("inf"), device=w.device)
        for i in range(int(MAX_SHRINK * CLIP_GRID)):
            max_val = org_max * (1 - i / CLIP_GRID)
            cur = torch.maximum(torch.minimum(wg, max_val), -max_val)
            q = int4.fake_quantize(cur.reshape(-1, K), group_size).reshape(cur.shape)
            err = (torch.einsum("sgk,ngk->sng", xg, q) - ref).pow(2).mean(dim=0)  # [n, ng]
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best_max = torch.where(better.unsqueeze(-1), max_val, best_max)
        out[n0:n0 + CLIP_CHUNK] = torch.maximum(torch.minimum(wg, best_max), -best_max).reshape(-1, K)
    return out


def quantize_rtn(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 with min/max group parameters: (codes, scales, zeros)."""
    s, z = int4.quantize_params(w, group_size)
    return int4.quantize_with(w, s, z, group_size), s, z


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

            # 2. clipping search, then rounding
            w = qkv.weight.float().clone()
            w[q_size + kv_size:] = search_clip(xs["qkv"], w[q_size + kv_size:], G)
            store_int4(qkv, *quantize_rtn(w, G), G)
            for key, mod in (("o", o), ("gu", gu), ("down", down)):
                store_int4(mod, *quantize_rtn(search_clip(xs[key], mod.weight.float(), G), G), G)


register("int4-awq", AwqHandler, lambda settings, name: Int4LinearMethod(settings.group_size))
