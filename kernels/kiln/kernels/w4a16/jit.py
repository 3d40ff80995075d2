"""Triton helpers shared by the W4A16 kernels (``gemv``, ``gemv2``, ``mma``).

Nibble extraction (``_nibble``: ``1 + q / 16`` in float32 with one LOP3) for the float32
kernels, and the packed-half (f16x2) arithmetic of ``gemv2``: f16x2 words travel as int32
tensors (one word = two float16 lanes, low lane first).  With ``ASM`` the helpers are one PTX
instruction (or a few) per word; without it (the CPU interpreter) they compute the same lanes
with unpack / float32 math / round / repack (same bits, same order).  The format they read is
``kiln.kernels.int4_format``; the derivations are in the package docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nibble(p, p_hi, i: tl.constexpr, ASM: tl.constexpr):
    """``1 + q / 16`` (float32, exact) for nibble ``i`` of the int32 words ``p``
    (``p_hi = p >> 12``: nibbles 5..7 come from it with left shifts too)."""
    if i <= 4:
        c = p << (19 - 4 * i)
    else:
        c = p_hi << (19 - 4 * (i - 3))
    if ASM:  # one LOP3 for the AND and the OR (ptxas emits two for the plain expression)
        c = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x780000, 0x3F800000, 0xEA;", "=r,r", [c],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        c = (c & 0x780000) | 0x3F800000
    return c.to(tl.float32, bitcast=True)


@triton.jit
def _x_offsets(offs_r, R: tl.constexpr):
    """K offset (within a step) of nibble 0 of packed row ``r``: ``64 (r // 8) + r % 8``."""
    if R == 8:
        return offs_r  # one block per step: contiguous (vector loads of x)
    else:
        return 64 * (offs_r // 8) + offs_r % 8



_H2_ONE_16TH = tl.constexpr(0x2C002C00)  # (1/16, 1/16)
_H2_ONE_256TH = tl.constexpr(0x1C001C00)  # (1/256, 1/256)
_H2_MAGIC = tl.constexpr(0x64006400)  # (1024, 1024): OR a nibble into the mantissa -> 1024 + q (or + 16 q)
_H2_ZC1 = tl.constexpr(0xD400D400 - (1 << 32))  # (-64, -64) as int32; | z -> -(64 + z/16) = -(1024 + z)/16
_H2_ZC2 = tl.constexpr(0xC400C400 - (1 << 32))  # (-4, -4) as int32; | (z << 4) -> -(4 + z/16) = -(64 + z)/16
_HI16 = tl.constexpr(-65536)  # 0xFFFF0000

_DEQUANT_ASM = tl.constexpr("""{
.reg .b32 t, u, v;
lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, $4, 8;
lop3.b32 $2, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $3, t, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 u, 0x2C002C00;
mov.b32 v, 0x1C001C00;
fma.rn.f16x2 $0, $0, u, $5;
fma.rn.f16x2 $1, $1, v, $6;
fma.rn.f16x2 $2, $2, u, $5;
fma.rn.f16x2 $3, $3, v, $6;
}""")

_XPAIR_F16_ASM = tl.constexpr("prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;")
_XPAIR_BF16_ASM = tl.constexpr("""{
.reg .b32 al, ah, bl, bh;
shl.b32 al, $2, 16;
and.b32 ah, $2, 0xFFFF0000;
shl.b32 bl, $3, 16;
and.b32 bh, $3, 0xFFFF0000;
cvt.rn.f16x2.f32 $0, bl, al;
cvt.rn.f16x2.f32 $1, bh, ah;
}""")


@triton.jit
def _h2_lo(w):
    """float32 value of the low float16 lane of int32 words ``w`` (fallback path)."""
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_hi(w):
    """float32 value of the high float16 lane of int32 words ``w`` (fallback path)."""
    return (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_pack(lo, hi):
    """int32 word of two float16 lanes (rounded from float32; fallback path)."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def _h2_fma(a, b, c, ASM: tl.constexpr):
    """``a * b + c`` per float16 lane (``fma.rn.f16x2``: one HFMA2)."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _h2_pack(_h2_lo(a) * _h2_lo(b) + _h2_lo(c), _h2_hi(a) * _h2_hi(b) + _h2_hi(c))


@triton.jit
def _h2_mul(a, b, ASM: tl.constexpr):
    """``a * b`` per float16 lane (``mul.rn.f16x2``: starts a chain without zeroing it)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return _h2_pack(_h2_lo(a) * _h2_lo(b), _h2_hi(a) * _h2_hi(b))


@triton.jit
def _h2_dequant(p, zc1, zc2, ASM: tl.constexpr):
    """Words ``((q_t - z_lo) / 16, (q_{t+4} - z_hi) / 16)`` for t = 0..3 (float16, exact) of the
    packed int32 words ``p`` (nibble i = bits 4i..4i+3), given ``zc1 = -(1024 + z) / 16`` and
    ``zc2 = -(64 + z) / 16`` per lane: one shift, four LOP3 and four HFMA2 per 8 weights."""
    if ASM:
        return tl.inline_asm_elementwise(_DEQUANT_ASM, "=r,=r,=r,=r,r,r,r", [p, zc1, zc2],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        t = (p >> 8) & 0xFFFFFF  # logical shift
        u = tl.full(p.shape, _H2_ONE_16TH, tl.int32)
        v = tl.full(p.shape, _H2_ONE_256TH, tl.int32)
        w0 = _h2_fma((p & 0x000F000F) | _H2_MAGIC, u, zc1, False)  # (1024 + q) / 16 - (1024 + z) / 16
        w1 = _h2_fma((p & 0x00F000F0) | _H2_MAGIC, v, zc2, False)  # (1024 + 16 q) / 256 - (64 + z) / 16
        w2 = _h2_fma((t & 0x000F000F) | _H2_MAGIC, u, zc1, False)
        w3 = _h2_fma((t & 0x00F000F0) | _H2_MAGIC, v, zc2, False)
        return w0, w1, w2, w3


@triton.jit
def _x_pairs(a, b, X_BF16: tl.constexpr, ASM: tl.constexpr):
    """From two words of x (``a = (x[k], x[k+1])``, ``b = (x[k'], x[k'+1])``, float16 or bfloat16)
    the float16 words ``(x[k], x[k'])`` and ``(x[k+1], x[k'+1])``."""
    if ASM:
        if X_BF16:
            return tl.inline_asm_elementwise(_XPAIR_BF16_ASM, "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_XPAIR_F16_ASM, "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)
    else:
        if X_BF16:
            al = (a << 16).to(tl.float32, bitcast=True)
            ah = (a & _HI16).to(tl.float32, bitcast=True)
            bl = (b << 16).to(tl.float32, bitcast=True)
            bh = (b & _HI16).to(tl.float32, bitcast=True)
            return _h2_pack(al, bl), _h2_pack(ah, bh)
        else:
            return (a & 0xFFFF) | (b << 16), ((a >> 16) & 0xFFFF) | (b & _HI16)


@triton.jit
def _h2_to_f32(w, ASM: tl.constexpr):
    """The two float16 lanes of ``w`` as float32 (two conversions)."""
    if ASM:
        return tl.inline_asm_elementwise("{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
                                         "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return _h2_lo(w), _h2_hi(w)


@triton.jit
def _h2_row(x0, x1, x2, x3, x4, x5, x6, x7, we0, we1, we2, we3, wo0, wo1, wo2, wo3, a, FIRST: tl.constexpr,
            X_BF16: tl.constexpr, ASM: tl.constexpr):
    """One row of x against two packed rows of a 64-column block (``we*``: row 2 jj, ``wo*``:
    row 2 jj + 1, from ``_h2_dequant``): eight HFMA2 into the float16 chain ``a`` (the first one
    a multiply when ``FIRST``).  ``x<i>`` [RB, 1]: the int32 word of x holding block columns
    ``8 i + 2 jj`` and ``8 i + 2 jj + 1``."""
    xe, xo = _x_pairs(x0, x4, X_BF16, ASM)
    if FIRST:
        a = _h2_mul(we0, xe, ASM)
    else:
        a = _h2_fma(we0, xe, a, ASM)
    a = _h2_fma(wo0, xo, a, ASM)
    xe, xo = _x_pairs(x1, x5, X_BF16, ASM)
    a = _h2_fma(we1, xe, a, ASM)
    a = _h2_fma(wo1, xo, a, ASM)
    xe, xo = _x_pairs(x2, x6, X_BF16, ASM)
    a = _h2_fma(we2, xe, a, ASM)
    a = _h2_fma(wo2, xo, a, ASM)
    xe, xo = _x_pairs(x3, x7, X_BF16, ASM)
    a = _h2_fma(we3, xe, a, ASM)
    a = _h2_fma(wo3, xo, a, ASM)
    return a


@triton.jit
def _h2_rows4(xr, mk, jp: tl.constexpr, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, acc,
              FIRST: tl.constexpr, X_BF16: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """One row of x against packed rows ``4 jp .. 4 jp + 3`` of a 64-column block (dequantized
    words ``a*``, ``b*``, ``c*``, ``d*``).  ``xr`` [RB, 1]: the block's first int64 word of x
    (four float16/bfloat16); word ``2 i + jp`` holds block columns ``8 i + 4 jp .. + 3``.
    ``EVEN``: no masks (``mk`` all true)."""
    v0 = _ld(xr + jp, mk, 0, EVEN)
    v1 = _ld(xr + 2 + jp, mk, 0, EVEN)
    v2 = _ld(xr + 4 + jp, mk, 0, EVEN)
    v3 = _ld(xr + 6 + jp, mk, 0, EVEN)
    v4 = _ld(xr + 8 + jp, mk, 0, EVEN)
    v5 = _ld(xr + 10 + jp, mk, 0, EVEN)
    v6 = _ld(xr + 12 + jp, mk, 0, EVEN)
    v7 = _ld(xr + 14 + jp, mk, 0, EVEN)
    acc = _h2_row(v0.to(tl.int32), v1.to(tl.int32), v2.to(tl.int32), v3.to(tl.int32), v4.to(tl.int32),
                  v5.to(tl.int32), v6.to(tl.int32), v7.to(tl.int32), a0, a1, a2, a3, b0, b1, b2, b3, acc, FIRST,
                  X_BF16, ASM)
    acc = _h2_row((v0 >> 32).to(tl.int32), (v1 >> 32).to(tl.int32), (v2 >> 32).to(tl.int32),
                  (v3 >> 32).to(tl.int32), (v4 >> 32).to(tl.int32), (v5 >> 32).to(tl.int32),
                  (v6 >> 32).to(tl.int32), (v7 >> 32).to(tl.int32), c0, c1, c2, c3, d0, d1, d2, d3, acc, False,
                  X_BF16, ASM)
    return acc


@triton.jit
def _ld(ptrs, mask, other, EVEN: tl.constexpr):
    """``tl.load`` that drops the mask when the tile is known to be in range (a masked load also
    zero-fills its registers first: one more instruction per two registers)."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _h2_flush(acc, a, s_lo, s_hi, ASM: tl.constexpr):
    """Add the float16 chain ``a`` into the float32 accumulator, each lane times its group's scale."""
    lo, hi = _h2_to_f32(a, ASM)
    return acc + s_lo * lo + s_hi * hi


@triton.jit
def _h2_group(s_ptrs, z_ptrs, stride_sg, stride_zg, mask, GROUP_SIZE: tl.constexpr, EVEN: tl.constexpr):
    """Per (block, column) group constants of the packed-half kernels from the scale and zero
    point pointers of the block's first group: the float32 scales of the low and high lanes
    (``s_lo``, ``s_hi``; different groups when G = 32: nibbles 4..7 are in the next group) and
    the zero-point words ``zc1 = -(1024 + z) / 16``, ``zc2 = -(64 + z) / 16`` per lane that
    ``_h2_dequant`` folds in."""
    s_lo = _ld(s_ptrs, mask, 0.0, EVEN).to(tl.float32)
    z = _ld(z_ptrs, mask, 0, EVEN).to(tl.int32)
    if GROUP_SIZE == 32:  # nibbles 4..7 (the high lanes) are in the next group
        s_hi = _ld(s_ptrs + stride_sg, mask, 0.0, EVEN).to(tl.float32)
        zz = z | (_ld(z_ptrs + stride_zg, mask, 0, EVEN).to(tl.int32) << 16)
    else:
        s_hi = s_lo
        zz = z * 0x10001
    return s_lo, s_hi, zz | _H2_ZC1, (zz << 4) | _H2_ZC2


@triton.jit
def _h2_flush4(acc0, acc1, acc2, acc3, h0, h1, h2, h3, s_lo, s_hi, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """``_h2_flush`` of the chains of the first ``BLOCK_M`` rows of x (the rest pass through)."""
    acc0 = _h2_flush(acc0, h0, s_lo, s_hi, ASM)
    if BLOCK_M >= 2:
        acc1 = _h2_flush(acc1, h1, s_lo, s_hi, ASM)
    if BLOCK_M >= 3:
        acc2 = _h2_flush(acc2, h2, s_lo, s_hi, ASM)
    if BLOCK_M >= 4:
        acc3 = _h2_flush(acc3, h3, s_lo, s_hi, ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _h2_rows_out(acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_N]`` result from the per-row float32 accumulators ``[RB, BLOCK_N]``
    (summed over the block rows; times 16: the weights were ``(q - z) / 16``)."""
    rows = tl.arange(0, BLOCK_M)[:, None]
    y = tl.where(rows == 0, 16.0 * tl.sum(acc0, axis=0)[None, :], 0.0)
    if BLOCK_M >= 2:
        y = tl.where(rows == 1, 16.0 * tl.sum(acc1, axis=0)[None, :], y)
    if BLOCK_M >= 3:
        y = tl.where(rows == 2, 16.0 * tl.sum(acc2, axis=0)[None, :], y)
    if BLOCK_M >= 4:
        y = tl.where(rows == 3, 16.0 * tl.sum(acc3, axis=0)[None, :], y)
    return y

