"""Attention over the paged KV cache (Triton): prefill, chunked prefill, decode, mixed batches.

One kernel, two launch modes behind one launcher (``paged_attention``):

* **decode** (every sequence has exactly one new query token): grid
  ``(num_seqs, num_kv_heads, num_splits)``.  A program loads the query rows of *all* query
  heads that share one KV head (GQA: the K/V tile is read once for the group) and walks one
  slice of the context; with ``num_splits > 1`` the context is split across programs
  (flash-decoding, Dao et al. 2023) and a second kernel merges the partial results with
  their running max and sum (log-sum-exp merge).  Splits are picked from
  the batch shape so that the grid fills the GPU; no device value is read on the host
  (CUDA-graph safe).
* **prefill / mixed** (any query lengths, variable per sequence through ``cu_seqlens_q``):
  grid ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)``.  Each program owns BLOCK_Q
  query tokens of one sequence times the G query heads of one KV head (BLOCK_M = BLOCK_Q *
  G rows) and finds its sequence by binary search over ``cu_seqlens_q`` (the grid is an
  upper bound; surplus programs exit), as in vLLM's unified Triton attention.  Query row
  ``j`` of a sequence of context ``L`` and ``q_len`` new tokens sits at position
  ``L - q_len + j`` and attends causally to keys ``0..L - q_len + j`` (cached prefix + the
  new tokens).

The inner loop is FlashAttention-2's (Dao 2023): online softmax in base 2 with running max
``m`` and sum ``l``, ``acc = acc * alpha + P @ V``; K/V tiles of BLOCK_N tokens are gathered
through the block table one token row at a time (``block_tables[s, n // block_size]``,
int64 offsets), which is vLLM's paged attention layout.  FP8 caches (float8_e4m3fn) are
converted in registers; the K scale is folded into the softmax scale and the V scale into
the output (a program sees one KV head, so per-head scales are scalars).  With a bf16 query
the two products then run in float16 (one conversion from e4m3; measured 10-25% faster than
bf16 products on the H200), so query values must stay under 65504 in magnitude; pass
``config={"fp8_f16_dot": False}`` to keep bf16 products.  With ``fp8_v_words`` (the decode
default) V is read as int32 words of four e4m3 values and each word is converted by one op
with four float16 results (``_e4m3_words_to_f16``); the four results are four operands of four
``tl.dot`` over the d residues ``4i + j``, interleaved back at the end.  Triton keeps a
multi-result op in the layout the words were loaded in, instead of loading the fp8 operand
byte by byte in the mma layout (measured on the H200: decode B384 447 -> 359 us;
docs/benchmarks.md).

Reference: ``reference.paged_attention_ref``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import (
    Scale,
    attention_config,
    check,
    check_last_dim_contiguous,
    decode_num_splits,
    interpreting,
    next_power_of_2,
    scale_args,
)
from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions
from kiln.kernels.pdl import launch_kwargs, pdl_start

__all__ = ["paged_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with cu[s] // BLOCK_Q + s <= pid (the sequence owning q-block ``pid``)."""
    lo = pid * 0  # tensors, not constexprs (num_seqs == 1 is specialized to a constant)
    hi = pid * 0 + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_scale(ptr, stride, val, head, MODE: tl.constexpr):
    """A KV dequantization scale: MODE 0 none (1.0), 1 the float ``val``, 2 ``ptr[head * stride]``."""
    s = 1.0
    if MODE == 2:
        s = tl.load(ptr + head * stride).to(tl.float32)
    elif MODE == 1:
        s = val
    return s


@triton.jit
def _e4m3_byte_to_f16(w, SHIFT: tl.constexpr):
    """Byte ``SHIFT // 8`` of int32 words ``w`` read as float8_e4m3fn, as float16 (exact for
    every finite value, subnormals included: the 7 exponent/mantissa bits move under float16's
    and the bias difference 2**8 is one multiply; e4m3fn NaN is not preserved)."""
    b = (w >> SHIFT) & 0xFF
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _e4m3_words_to_f16(w, PTX: tl.constexpr):
    """Bytes 0..3 of int32 words ``w`` (four float8_e4m3fn values each) as four float16 tensors
    of w's shape.  PTX: two ``cvt.rn.f16x2.e4m3x2`` per word (sm_89+); else integer
    arithmetic (the interpreter, CPU tests)."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
            "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        return (_e4m3_byte_to_f16(w, 0), _e4m3_byte_to_f16(w, 8), _e4m3_byte_to_f16(w, 16),
                _e4m3_byte_to_f16(w, 24))


# num_seqs is not specialized (Triton would compile separate variants for 1, multiples of 16
# and other counts; the search over cu_seqlens costs nothing either way).
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, cu_ptr,
    k_scale_ptr, k_scale_stride, k_scale_val, v_scale_ptr, v_scale_stride, v_scale_val,
    sm_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_pt, stride_ph,  # partials: row (t, h, split) = t * stride_pt + h * stride_ph + split
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,  # head dim; KV cache block size (tokens)
    G: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_DECODE: tl.constexpr, PART_STRIDE: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr, DOT_PREC: tl.constexpr,
    F16_DOT: tl.constexpr,  # fp8 cache: run both products in float16 (one cvt from e4m3)
    V_WORDS: tl.constexpr = False,  # fp8 + F16_DOT: V read as int32 words (see _e4m3_words_to_f16)
    CVT_PTX: tl.constexpr = 0,  # V_WORDS conversion through PTX (GPU) instead of integer arithmetic
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # --- which sequence and which of its query tokens this program owns
    if IS_DECODE:
        s = pid
        q_local0 = 0
    else:
        s = _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q)
        q_local0 = (pid - (tl.load(cu_ptr + s) // BLOCK_Q + s)) * BLOCK_Q
    q_start = tl.load(cu_ptr + s)
    q_len = tl.load(cu_ptr + s + 1) - q_start
    if q_local0 >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + s)

    rows = tl.arange(0, BLOCK_M)
    r_q = rows // G  # query token within the block
    r_h = rows % G  # query head within the group
    q_local = q_local0 + r_q
    row_ok = (r_q < BLOCK_Q) & (q_local < q_len)
    tok = (q_start + q_local).to(tl.int64)
    head = kvh * G + r_h
    q_pos = ctx - q_len + q_local  # absolute position of each row's query token

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if F16_DOT:
        q = q.to(tl.float16)

    # keys this q-block can see: 0 .. position of its last query token
    kv_end = ctx - q_len + tl.minimum(q_len, q_local0 + BLOCK_Q)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)
    else:
        kv_lo = 0
        kv_hi = kv_end

    k_scale = _load_scale(k_scale_ptr, k_scale_stride, k_scale_val, kvh, K_SCALE_MODE)
    v_scale = _load_scale(v_scale_ptr, v_scale_stride, v_scale_val, kvh, V_SCALE_MODE)
    qk_scale = sm_scale * 1.4426950408889634 * k_scale  # base-2 softmax

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh
    dw = tl.arange(0, BLOCK_D // 4)  # word i holds d = 4i .. 4i + 3
    dw_ok = dw < HEAD_DIM // 4
    if V_WORDS:
        v_words = v_head.to(tl.pointer_type(tl.int32), bitcast=True)
        acc0 = tl.zeros([BLOCK_M, BLOCK_D // 4], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, BLOCK_D // 4], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D // 4], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_M, BLOCK_D // 4], dtype=tl.float32)

    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        k = tl.load(
            k_head + (blk * stride_kb + off * stride_kt)[None, :] + d[:, None],
            mask=n_ok[None, :] & d_ok[:, None], other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        sc = tl.dot(q, k.to(q.dtype), input_precision=DOT_PREC) * qk_scale
        ok = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_WORDS:
            # V as int32 words (4 e4m3 each): word i of a row holds d = 4i..4i+3; four dots of
            # [BLOCK_M, BLOCK_N] x [BLOCK_N, BLOCK_D // 4] accumulate the four d residues
            vw = tl.load(
                v_words + (blk * stride_vb + off * stride_vt)[:, None] // 4 + dw[None, :],
                mask=n_ok[:, None] & dw_ok[None, :], other=0,
            )  # [BLOCK_N, BLOCK_D // 4] int32
            v0, v1, v2, v3 = _e4m3_words_to_f16(vw, CVT_PTX)
            pp = p.to(q.dtype)
            acc0 = acc0 * alpha[:, None] + tl.dot(pp, v0)
            acc1 = acc1 * alpha[:, None] + tl.dot(pp, v1)
            acc2 = acc2 * alpha[:, None] + tl.dot(pp, v2)
            acc3 = acc3 * alpha[:, None] + tl.dot(pp, v3)
        else:
            v = tl.load(
                v_head + (blk * stride_vb + off * stride_vt)[:, None] + d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new

    if V_WORDS:  # interleave the four residues back: column 4i + j = acc_j[:, i]
        acc = tl.reshape(tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)), [BLOCK_M, BLOCK_D])
    acc = acc * v_scale
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        prow = (tok * stride_pt + head * stride_ph + split) * PART_STRIDE  # row of [T * Hq * NUM_SPLITS]
        tl.store(part_m_ptr + prow, m_i, mask=row_ok)
        tl.store(part_l_ptr + prow, l_i, mask=row_ok)
        tl.store(part_acc_ptr + prow[:, None] + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_row(out_row_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, prow0, head_dim,
               NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr, PART_STRIDE: tl.constexpr):
    """Flash-decoding reduce of one (token, head): ``out = sum_i 2^(m_i - M) acc_i / sum_i
    2^(m_i - M) l_i`` over the split partials in rows ``prow0 + i`` (base-2 maxima ``m_i``,
    sums ``l_i``, unnormalized ``acc_i`` [head_dim]), read past L1 (``.cg``)."""
    sp = tl.arange(0, SPLITS_P2)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    prow = (prow0 + sp) * PART_STRIDE
    m = tl.load(part_m_ptr + prow, mask=sp_ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_l_ptr + prow, mask=sp_ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(sp_ok, tl.math.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(part_acc_ptr + prow[:, None] + d[None, :], mask=sp_ok[:, None], other=0.0, cache_modifier=".cg")
    o = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_row_ptr + d, o.to(out_row_ptr.dtype.element_ty), mask=d < head_dim)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    stride_ot, stride_oh, stride_pt, stride_ph, head_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr, PART_STRIDE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[t, h] = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i  (flash-decoding reduce)."""
    pdl_start(PDL)  # programmatic dependent launch (kiln.kernels.pdl)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    _merge_row(out_ptr + t * stride_ot + h * stride_oh, part_acc_ptr, part_m_ptr, part_l_ptr,
               t * stride_pt + h * stride_ph, head_dim, NUM_SPLITS, SPLITS_P2, BLOCK_D, PART_STRIDE)


_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Launch meta-parameters a caller may override (``paged_attention(config=...)``).
CONFIG_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg", "fp8_f16_dot", "fp8_v_words"})


def _words_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether an fp8 cache can be read as int32 words: head_dim, every stride and the base
    address multiples of 4 bytes."""
    return head_dim % 4 == 0 and all(
        t.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:3]) for t in (k_cache, v_cache))


def _partials(rows: int, row_floats: int, block_d: int, like: torch.Tensor):
    """Flash-decoding partials in one float32 allocation of ``rows`` rows ``[acc (block_d) | m |
    l | pad]`` (``row_floats`` floats each): views ``(acc [rows, block_d], m [rows], l [rows])``."""
    part = torch.empty(rows, row_floats, dtype=torch.float32, device=like.device)
    return part[:, :block_d], part[:, block_d], part[:, block_d + 1]


def _grid(decode: bool, T: int, S: int, G: int, Hkv: int, cfg: dict, device: torch.device,
          num_splits: Optional[int], max_seq_len: Optional[int]) -> tuple[int, int, int, int]:
    """``(BLOCK_Q, BLOCK_M, splits, programs along grid axis 0)`` of a launch: decode, one
    program per sequence with all G query heads of a KV head (split over the context to fill
    the GPU); prefill, ``BLOCK_Q`` query tokens x G heads per program, ``T // BLOCK_Q + S``
    programs (an upper bound: surplus programs exit)."""
    if decode:
        block_m = max(16, next_power_of_2(G))
        return 1, block_m, max(1, int(num_splits or decode_num_splits(S, Hkv, device, max_seq_len))), S
    block_m = max(cfg["BLOCK_M"], 16, next_power_of_2(G))
    block_q = block_m // G
    return block_q, block_m, max(1, int(num_splits or 1)), T // block_q + S


def _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> None:
    """ValueError unless the arguments of ``paged_attention`` fit (its docstring)."""
    check(q.dim() == 3, f"q must be [T, Hq, D], got {tuple(q.shape)}")
    _, Hq, D = q.shape
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
          f"k_cache/v_cache must be equal [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    _, _, Hkv, Dk = k_cache.shape
    check(Dk == D, f"cache head_dim {Dk} != q head_dim {D}")
    check(Hq % Hkv == 0, f"num query heads {Hq} is not a multiple of num kv heads {Hkv}")
    check(q.dtype in _MODEL_DTYPES, f"unsupported q dtype {q.dtype}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    check(fp8 or k_cache.dtype == q.dtype, f"cache dtype {k_cache.dtype} must be q's ({q.dtype}) or float8_e4m3fn")
    check(block_tables.dim() == 2 and block_tables.dtype == torch.int32, "block_tables must be int32 [S, max_blocks]")
    S = block_tables.shape[0]
    check(seq_lens.shape == (S,) and seq_lens.dtype == torch.int32, f"seq_lens must be int32 [{S}]")
    check(cu_seqlens_q.shape == (S + 1,) and cu_seqlens_q.dtype == torch.int32, f"cu_seqlens_q must be int32 [{S + 1}]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        check(t.device == q.device, f"{name} on {t.device}, q on {q.device}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    check(seq_lens.is_contiguous() and cu_seqlens_q.is_contiguous(), "seq_lens and cu_seqlens_q must be contiguous")


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # int32 [S, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [S]
    cu_seqlens_q: torch.Tensor,  # int32 [S + 1]
    scale: float,
    k_scale: Scale = None,
    v_scale: Scale = None,
    *,
    out: Optional[torch.Tensor] = None,
    max_query_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    config: Optional[dict] = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of the new query tokens over the paged KV cache.

    Semantics are those of ``reference.paged_attention_ref``: sequence ``s`` owns query rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``; ``seq_lens[s]`` counts its whole context
    including those new tokens (already written with ``reshape_and_cache``); query head
    ``h`` uses KV head ``h // (Hq // Hkv)``.

    Args:
        q: ``[T, Hq, D]`` float16/bfloat16/float32, last dim contiguous (token and head
            strides free: a view of a fused QKV output works).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype or float8_e4m3fn;
            last dim contiguous, other strides free.
        block_tables: int32 ``[S, max_blocks_per_seq]``, row stride free, last dim
            contiguous.  Only entries covering ``seq_lens[s]`` tokens are read.
        seq_lens: int32 ``[S]``; 0 for a padded (idle) decode slot, whose output is zeros.
        cu_seqlens_q: int32 ``[S + 1]``, ``cu_seqlens_q[0] == 0``, non-decreasing, and
            ``q_len <= seq_len`` per sequence (not checked on the device).
        scale: softmax scale (usually ``D ** -0.5``).
        k_scale, v_scale: dequantization scales of an fp8 cache (float, 1-element or
            ``[Hkv]`` float32 tensor); ignored for other cache dtypes.
        out: optional ``[T, Hq, D]`` destination in q's dtype, last dim contiguous.
        max_query_len: largest ``q_len`` in the batch if the caller knows it.  1 selects
            the decode kernel.  When None, the decode kernel is used iff ``T == S`` (then
            every sequence must have exactly one query row).
        num_splits: force the number of context splits (decode mode; tests, tuning).
        max_seq_len: optional upper bound of ``seq_lens``; lets the decode heuristic avoid
            splitting short contexts.  Must be a host int.
        config: override of the launch meta-parameters from the device's tuning table
            (keys ``CONFIG_KEYS``: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``;
            ``maxnreg``, a register cap; fp8 caches: ``fp8_f16_dot``, ``fp8_v_words``: V read
            as int32 words and converted in registers); for tuning.
        options: the engine's kernel options (programmatic dependent launch).
    Returns:
        ``out``: ``[T, Hq, D]`` in q's dtype.  Rows after ``cu_seqlens_q[-1]`` are left
        unwritten.
    Raises:
        ValueError: bad shapes, dtypes, devices or strides; a ``config`` key outside
            ``CONFIG_KEYS``.
    """
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    S = block_tables.shape[0]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if out is None:
        out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    check(out.shape == (T, Hq, D) and out.dtype == q.dtype and out.device == q.device, "bad out tensor")
    check_last_dim_contiguous("out", out)
    if T == 0 or S == 0:
        return out

    G = Hq // Hkv
    decode = max_query_len == 1 if max_query_len is not None else T == S
    kind = ("decode_fp8" if fp8 else "decode") if decode else "prefill"
    cfg = attention_config(kind, q.device)
    unknown = sorted(set(config or {}) - CONFIG_KEYS)
    check(not unknown, f"unknown attention config key(s) {unknown}; expected some of {sorted(CONFIG_KEYS)}")
    cfg.update(config or {})
    BLOCK_D = max(16, next_power_of_2(D))
    BLOCK_N = cfg["BLOCK_N"]
    BLOCK_Q, BLOCK_M, splits, grid0 = _grid(decode, T, S, G, Hkv, cfg, q.device, num_splits, max_seq_len)

    ks = scale_args(k_scale if fp8 else None, Hkv, q, "k_scale")
    vs = scale_args(v_scale if fp8 else None, Hkv, q, "v_scale")
    part_stride = BLOCK_D + 4  # floats per partial row; a multiple of 4 keeps rows 16-byte aligned
    part_acc, part_m, part_l = _partials(T * Hq * splits, part_stride, BLOCK_D, out) if splits > 1 else (out,) * 3
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    f16_dot = fp8 and q.dtype != torch.float32 and cfg.get("fp8_f16_dot", True)
    # V as int32 words: dots need >= 16 words; int32 views need 4-byte aligned rows (true for
    # the runtime's caches)
    v_words = bool(f16_dot and cfg.get("fp8_v_words", False) and BLOCK_D >= 64 and _words_ok(k_cache, v_cache, D))
    _paged_attn_kernel[(grid0, Hkv, splits)](
        q, k_cache, v_cache, out,
        part_acc, part_m, part_l,
        block_tables, seq_lens, cu_seqlens_q,
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        float(scale), S,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        Hq * splits, splits,
        HEAD_DIM=D, BLOCK_SIZE=block_size, G=G, BLOCK_Q=BLOCK_Q, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        NUM_SPLITS=splits, IS_DECODE=decode, PART_STRIDE=part_stride,
        K_SCALE_MODE=ks[3], V_SCALE_MODE=vs[3], DOT_PREC=dot_prec, F16_DOT=f16_dot,
        V_WORDS=v_words, CVT_PTX=v_words and q.is_cuda and not interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {}),  # register cap (occupancy)
        **launch_kwargs(q.device, options),
    )
    if splits > 1:
        _merge_splits_kernel[(T, Hq)](
            out, part_acc, part_m, part_l, out.stride(0), out.stride(1), Hq * splits, splits, D,
            NUM_SPLITS=splits, SPLITS_P2=next_power_of_2(splits), BLOCK_D=BLOCK_D, PART_STRIDE=part_stride,
            num_warps=1 if BLOCK_D * splits <= 1024 else 4, **launch_kwargs(q.device, options))
    return out
