"""Unpacking the weights of pre-quantized checkpoints into Kiln's tensors, one linear layer
at a time: pure torch, no model.

Each ``unpack_*`` function takes the checkpoint tensors of one Hugging Face linear layer
(``q_proj``, ``down_proj``, ...) keyed by suffix (``weight_packed``, ``qweight``, ...) and
returns the layer in Kiln's unfused per-layer form, which ``checkpoint.load_checkpoint``
concatenates along the output features for the fused QKV and gate-up layers:

* ``fp8``: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` float32 [N];
* ``int8``: ``weight`` int8 [N, K], ``weight_scale`` float32 [N];
* ``int4``: ``codes`` int32 [N, K] (0..15), ``scales`` float32 [N, K // G],
  ``zeros`` float32 [N, K // G] (0..15), with ``W = (codes - zeros) * scales``, which
  ``kiln.kernels.int4_format.pack`` stores.

The published layouts read here:

* compressed-tensors (``llmcompressor``; ``compressed_tensors.compressors``): ``weight``
  [N, K] in the quantized dtype and ``weight_scale`` [N, 1] (channel) or [1] / [] (tensor)
  for ``float-quantized`` and ``int-quantized``; for ``pack-quantized`` ``weight_packed``
  int32 [N, ceil(K / 8)] with element ``k`` of a row in bits ``4 (k % 8)`` of word ``k // 8``
  holding ``q + 8`` (``q`` the signed code in -8..7), ``weight_scale`` [N, K // G] and, when
  asymmetric, ``weight_zero_point`` int32 [ceil(N / 8), K // G] packed the same way along
  the output rows; ``W = (q - zp) * scale``.
* GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` ``gptq``): ``qweight`` int32
  [K / 8, N] packed along K (bits ``4 (k % 8)`` of row ``k // 8``), ``qzeros`` int32
  [K / G, N / 8] packed along N, ``scales`` float16 [K / G, N], ``g_idx`` int32 [K];
  ``W = (q - (z + 1)) * scale`` (the format stores zeros minus one; ``gptq_v2`` stores them
  as they are).
* AutoAWQ GEMM (``version: gemm``): ``qweight`` int32 [K, N / 8] and ``qzeros`` int32
  [K / G, N / 8] packed along N with AWQ's interleave (nibble ``i`` of a word holds output
  column ``8 w + AWQ_ORDER[i]``), ``scales`` float16 [K / G, N]; ``W = (q - z) * scale``.
"""

from __future__ import annotations

import torch

from .fp8 import FP8

__all__ = ["CheckpointFormatError", "AWQ_ORDER", "unpack_nibbles", "unpack_ct_float", "unpack_ct_int8",
           "unpack_ct_packed", "unpack_gptq", "unpack_awq"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) held by nibble i of an AutoAWQ word


class CheckpointFormatError(ValueError):
    """A pre-quantized checkpoint that does not match its declared format (a missing tensor,
    a wrong shape or dtype, an unsupported setting).  The message names the tensor or field."""


def _need(parts: dict[str, torch.Tensor], prefix: str, *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in parts]
    if missing:
        raise CheckpointFormatError(f"checkpoint lacks {prefix}.{missing[0]} (the layer has "
                                    f"{', '.join(sorted(parts)) or 'no tensors'})")
    return [parts[n] for n in names]


def _shape(t: torch.Tensor, want: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise CheckpointFormatError(f"{name} has shape {tuple(t.shape)}, expected {tuple(want)}")


def _dtype(t: torch.Tensor, want: tuple[torch.dtype, ...], name: str) -> None:
    if t.dtype not in want:
        raise CheckpointFormatError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}, expected "
                                    f"{' or '.join(str(w).replace('torch.', '') for w in want)}")


def unpack_nibbles(packed: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """4-bit fields of int32 words, low nibble first: element ``i`` along ``dim`` of the result
    is bits ``4 (i % 8) .. 4 (i % 8) + 3`` of word ``i // 8`` along ``dim``.

    Args:
        packed: int32 [R, W] (``dim`` 1) or [W, C] (``dim`` 0).
        count: elements along ``dim`` (<= 8 W; the tail of the last word is padding).
    Returns:
        int32 with ``count`` elements along ``dim``, values 0..15.
    """
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device) * 4
    if dim == 1:
        q = (packed.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF  # [R, W, 8]
        return q.reshape(packed.shape[0], -1)[:, :count]
    q = (packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF  # [W, 8, C]
    return q.reshape(-1, packed.shape[1])[:count]


def _per_row_scale(scale: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """float32 [N] from a channel ([N, 1] / [N]) or tensor ([1] / [] / [1, 1]) scale."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(n).contiguous()
    if scale.numel() != n or (scale.dim() == 2 and scale.shape[1] != 1):
        raise CheckpointFormatError(f"{name} has shape {tuple(scale.shape)}, expected ({n}, 1) (per channel) "
                                    f"or (1,) (per tensor)")
    return scale.float().reshape(n).contiguous()


def unpack_ct_float(parts: dict, prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """compressed-tensors ``float-quantized`` FP8 E4M3 -> Kiln ``fp8`` (see the module doc)."""
    w, s = _need(parts, prefix, "weight", "weight_scale")
    _shape(w, (n, k), f"{prefix}.weight")
    _dtype(w, (FP8,), f"{prefix}.weight")
    return {"weight": w.contiguous(), "weight_scale": _per_row_scale(s, n, f"{prefix}.weight_scale")}


def unpack_ct_int8(parts: dict, prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """compressed-tensors ``int-quantized`` 8-bit symmetric -> Kiln ``int8``."""
    w, s = _need(parts, prefix, "weight", "weight_scale")
    _shape(w, (n, k), f"{prefix}.weight")
    _dtype(w, (torch.int8,), f"{prefix}.weight")
    return {"weight": w.contiguous(), "weight_scale": _per_row_scale(s, n, f"{prefix}.weight_scale")}


def _groups(k: int, g: int, prefix: str) -> int:
    if k % g:
        raise CheckpointFormatError(f"{prefix}: group size {g} does not divide its {k} input features")
    return k // g


def _check_g_idx(parts: dict, names: tuple[str, ...], prefix: str, k: int, g: int) -> None:
    """A ``g_idx`` (activation order) tensor must be the trivial ``k // G`` map: Kiln's format
    has no column permutation."""
    for name in names:
        if name in parts:
            gi = parts[name]
            want = torch.arange(k, device=gi.device) // g
            if gi.numel() != k or not torch.equal(gi.reshape(-1).long(), want):
                raise CheckpointFormatError(
                    f"{prefix}.{name} permutes the groups (activation order, desc_act / actorder: group): "
                    f"not supported; quantize with desc_act false (actorder static or none)")


def unpack_ct_packed(parts: dict, prefix: str, n: int, k: int, group_size: int, symmetric: bool) -> dict:
    """compressed-tensors ``pack-quantized`` 4-bit -> Kiln ``int4`` codes (see the module doc)."""
    wp, s = _need(parts, prefix, "weight_packed", "weight_scale")
    _dtype(wp, (torch.int32,), f"{prefix}.weight_packed")
    _shape(wp, (n, (k + 7) // 8), f"{prefix}.weight_packed")
    if "weight_shape" in parts and [int(v) for v in parts["weight_shape"].reshape(-1)] != [n, k]:
        raise CheckpointFormatError(f"{prefix}.weight_shape is {parts['weight_shape'].tolist()}, expected {[n, k]}")
    ng = _groups(k, group_size, prefix)
    _shape(s, (n, ng), f"{prefix}.weight_scale")
    _check_g_idx(parts, ("weight_g_idx",), prefix, k, group_size)
    codes = unpack_nibbles(wp, k, dim=1)  # q + 8
    if symmetric:
        zeros = torch.full((n, ng), 8.0)
    else:
        (zp,) = _need(parts, prefix, "weight_zero_point")
        if zp.dtype == torch.int32 and tuple(zp.shape) == ((n + 7) // 8, ng):
            zeros = unpack_nibbles(zp, n, dim=0).float()  # zp + 8
        elif tuple(zp.shape) == (n, ng) and not zp.is_floating_point():
            zeros = zp.float() + 8.0
        else:
            raise CheckpointFormatError(f"{prefix}.weight_zero_point has shape {tuple(zp.shape)}, expected "
                                        f"({(n + 7) // 8}, {ng}) (packed int32)")
    return {"codes": codes, "scales": s.float(), "zeros": zeros}


def unpack_gptq(parts: dict, prefix: str, n: int, k: int, group_size: int, zero_offset: int) -> dict:
    """GPTQ ``qweight`` / ``qzeros`` / ``scales`` -> Kiln ``int4`` codes (see the module doc).

    Args:
        zero_offset: added to the stored zero points (1 for ``checkpoint_format: gptq``, whose
            zeros are stored minus one; 0 for ``gptq_v2``).
    """
    qw, qz, s = _need(parts, prefix, "qweight", "qzeros", "scales")
    ng = _groups(k, group_size, prefix)
    for t, shape, name in ((qw, (k // 8, n), "qweight"), (qz, (ng, n // 8), "qzeros"), (s, (ng, n), "scales")):
        _shape(t, shape, f"{prefix}.{name}")
    _dtype(qw, (torch.int32,), f"{prefix}.qweight")
    _dtype(qz, (torch.int32,), f"{prefix}.qzeros")
    _check_g_idx(parts, ("g_idx",), prefix, k, group_size)
    codes = unpack_nibbles(qw, k, dim=0).t()  # [N, K]
    zeros = (unpack_nibbles(qz, n, dim=1) + zero_offset).t().float()  # [N, K/G]
    if zero_offset and int(zeros.max()) > 15:
        raise CheckpointFormatError(f"{prefix}.qzeros holds a zero point of 16 (stored 15 in a v1 'gptq' "
                                    f"checkpoint): not representable in 4 bits")
    return {"codes": codes, "scales": s.float().t(), "zeros": zeros}


def _awq_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """[R, N / 8] AutoAWQ words -> [R, N] values in output-column order."""
    q = unpack_nibbles(packed, n, dim=1).reshape(packed.shape[0], n // 8, 8)  # nibble order
    inv = torch.empty(8, dtype=torch.long)
    inv[list(AWQ_ORDER)] = torch.arange(8)
    return q[:, :, inv].reshape(packed.shape[0], n)


def unpack_awq(parts: dict, prefix: str, n: int, k: int, group_size: int) -> dict:
    """AutoAWQ GEMM ``qweight`` / ``qzeros`` / ``scales`` -> Kiln ``int4`` codes."""
    qw, qz, s = _need(parts, prefix, "qweight", "qzeros", "scales")
    ng = _groups(k, group_size, prefix)
    for t, shape, name in ((qw, (k, n // 8), "qweight"), (qz, (ng, n // 8), "qzeros"), (s, (ng, n), "scales")):
        _shape(t, shape, f"{prefix}.{name}")
    _dtype(qw, (torch.int32,), f"{prefix}.qweight")
    _dtype(qz, (torch.int32,), f"{prefix}.qzeros")
    return {"codes": _awq_unpack(qw, n).t().contiguous(), "scales": s.float().t(),
            "zeros": _awq_unpack(qz, n).t().float()}
