"""Offline check of programmatic dependent launch in the compiled kernels (no GPU needed).

Compiles each kernel that ``kiln.kernels.pdl.launch_kwargs`` launches, for sm_90 with Triton's
bundled ptxas, with ``PDL`` True and (a few) False, disassembles it and reports, per kernel:
the index of ``griddepcontrol.wait`` (SASS ``ACQBULK``) and ``launch_dependents``
(``PREEXIT``), and of the first global-memory instruction.  Rule (1) of ``kiln.kernels.pdl``
holds when the wait comes before every global load and store.  Prints one JSON object;
``tests/kernels/test_pdl.py`` runs it in a subprocess without ``TRITON_INTERPRET`` (the
interpreter replaces ``triton.jit`` functions at import time).

Usage: ``python3 benchmarks/pdl_sass_check.py [kernel ...]`` (with ``kiln.kernels`` importable)
"""

from __future__ import annotations

import json
import re
import sys

import triton.language as tl

from kiln.kernels import activation, attention, cache, gemv, norm, rotary
from kiln.kernels.w4a16 import dequant as w4a16_dequant
from kiln.kernels.w4a16 import gemv as w4a16_gemv
from kiln.kernels.w4a16 import gemv2 as w4a16_gemv2
from kiln.kernels.w4a16 import mma as w4a16_mma
from kiln.kernels.w4a16 import swap as w4a16_swap
from sass_count import _compile, _sass  # benchmarks/sass_count.py (this script's folder is on sys.path)

_MEM = re.compile(r"^\s*(?:/\*[0-9a-f]+\*/\s*)?(?:@!?U?P\w+\s+)?(LDG|STG|ATOMG|ATOM|RED|REDG|LDGSTS|LD|ST|UTMALDG|"
                  r"UTMASTG|UBLKCP|UBLKPF)\b")
_OP = re.compile(r"^\s*(?:/\*[0-9a-f]+\*/\s*)?(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\b.*;")

_F16 = "*fp16"
_I32 = "*i32"
_F32 = "*fp32"

# kernel name -> (jit function, pointer types, other non-i32 scalar types, constexprs, warps, stages)
KERNELS = {
    "rms_norm": (norm._rms_norm_kernel, {"q_ptr": "*fp8e4nv", "s_ptr": _F32}, {"eps": "fp32"},
                 dict(HAS_RESIDUAL=True, BLOCK=4096), 8, 1),
    "silu_and_mul": (activation._silu_and_mul_kernel, {}, {}, dict(BLOCK=1024), 4, 1),
    "rotary": (rotary._rotary_kernel, {"pos_ptr": "*i64"}, {}, dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_D=64), 4, 1),
    "reshape_and_cache": (cache._reshape_and_cache_kernel, {"slot_ptr": "*i64", "k_scale_ptr": _F32,
                                                            "v_scale_ptr": _F32},
                          {"k_scale_val": "fp32", "v_scale_val": "fp32"},
                          dict(SCALE_MODE_K=0, SCALE_MODE_V=0, FP8=False, ROUND_FP8=False, BLOCK_H=8, BLOCK_D=128),
                          4, 1),
    "rotary_and_cache": (cache._rotary_cache_kernel, {"pos_ptr": "*i64", "cs_ptr": _F32, "slot_ptr": "*i64",
                                                      "k_scale_ptr": _F32, "v_scale_ptr": _F32},
                         {"k_scale_val": "fp32", "v_scale_val": "fp32"},
                         dict(SCALE_MODE_K=0, SCALE_MODE_V=0, FP8=False, ROUND_FP8=False, BLOCK_HQ=32, BLOCK_H=8,
                              BLOCK_HALF=64), 4, 1),
    "paged_attention": (attention._paged_attn_kernel,
                        {"part_acc_ptr": _F32, "part_m_ptr": _F32, "part_l_ptr": _F32, "block_tables_ptr": _I32,
                         "seq_lens_ptr": _I32, "cu_ptr": _I32, "k_scale_ptr": _F32, "v_scale_ptr": _F32},
                        {"k_scale_val": "fp32", "v_scale_val": "fp32", "sm_scale": "fp32"},
                        dict(HEAD_DIM=128, BLOCK_SIZE=16, G=4, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128,
                             NUM_SPLITS=1, IS_DECODE=False, PART_STRIDE=1, K_SCALE_MODE=0, V_SCALE_MODE=0,
                             DOT_PREC="tf32", F16_DOT=False, V_WORDS=False, CVT_PTX=0), 4, 2),
    "paged_attention_decode": (attention._paged_attn_kernel,
                               {"part_acc_ptr": _F32, "part_m_ptr": _F32, "part_l_ptr": _F32,
                                "block_tables_ptr": _I32, "seq_lens_ptr": _I32, "cu_ptr": _I32,
                                "k_scale_ptr": _F32, "v_scale_ptr": _F32},
                               {"k_scale_val": "fp32", "v_scale_val": "fp32", "sm_scale": "fp32"},
                               dict(HEAD_DIM=128, BLOCK_SIZE=16, G=4, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64,
                                    BLOCK_D=128, NUM_SPLITS=8, IS_DECODE=True, PART_STRIDE=132, K_SCALE_MODE=0,
                                    V_SCALE_MODE=0, DOT_PREC="tf32", F16_DOT=False, V_WORDS=False, CVT_PTX=0), 4, 2),
    "paged_attention_fp8_v_words": (attention._paged_attn_kernel,
                                    {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "out_ptr": "*bf16",
                                     "q_ptr": "*bf16", "part_acc_ptr": _F32, "part_m_ptr": _F32,
                                     "part_l_ptr": _F32, "block_tables_ptr": _I32, "seq_lens_ptr": _I32,
                                     "cu_ptr": _I32, "k_scale_ptr": _F32, "v_scale_ptr": _F32},
                                    {"k_scale_val": "fp32", "v_scale_val": "fp32", "sm_scale": "fp32"},
                                    dict(HEAD_DIM=128, BLOCK_SIZE=16, G=4, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=128,
                                         BLOCK_D=128, NUM_SPLITS=1, IS_DECODE=True, PART_STRIDE=132,
                                         K_SCALE_MODE=2, V_SCALE_MODE=2, DOT_PREC="tf32", F16_DOT=True,
                                         V_WORDS=True, CVT_PTX=1), 4, 2),
    "merge_splits": (attention._merge_splits_kernel, {"part_acc_ptr": _F32, "part_m_ptr": _F32, "part_l_ptr": _F32},
                     {}, dict(NUM_SPLITS=4, SPLITS_P2=4, BLOCK_D=128, PART_STRIDE=1), 1, 1),
    "gemv": (gemv._gemv_kernel, {"part_ptr": _F32, "cnt_ptr": _I32}, {},
             dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048, EVEN_K=True, HAS_SPLIT=True, NUM_STAGES=1), 4, 1),
    "w4a16_gemv2": (w4a16_gemv2._gemv2_kernel, {"xw_ptr": "*i64", "qw_ptr": _I32, "z_ptr": "*u8", "part_ptr": _F32,
                                          "cnt_ptr": _I32}, {},
                    dict(GROUP_SIZE=128, BLOCK_M=1, BLOCK_N=128, BLOCK_K=256, CHAIN=8, HAS_SPLIT=True, NUM_STAGES=2,
                         X_BF16=False, ASM=True, EVEN_K=True, EVEN_N=True, EVEN_M=True, PREFETCH=0), 4, 2),
    "w4a16_gemv2_prefetch": (w4a16_gemv2._gemv2_kernel, {"xw_ptr": "*i64", "qw_ptr": _I32, "z_ptr": "*u8", "part_ptr": _F32,
                                                   "cnt_ptr": _I32}, {},
                             dict(GROUP_SIZE=128, BLOCK_M=1, BLOCK_N=32, BLOCK_K=2048, CHAIN=8, HAS_SPLIT=False,
                                  NUM_STAGES=1, X_BF16=True, ASM=True, EVEN_K=True, EVEN_N=True, EVEN_M=True,
                                  PREFETCH=1), 4, 1),
    "w4a16_swap": (w4a16_swap._swap_kernel, {"qw_ptr": _I32, "z_ptr": "*u8", "part_ptr": _F32, "cnt_ptr": _I32}, {},
                   dict(GROUP_SIZE=128, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, HAS_SPLIT=True, NUM_STAGES=3, ASM=True,
                        X_F16=True, EVEN_N=True, PREFETCH=1), 4, 3),
    "w4a16_mma": (w4a16_mma._mma_kernel, {"qw_ptr": _I32, "z_ptr": "*u8", "part_ptr": _F32, "cnt_ptr": _I32}, {},
                  dict(GROUP_SIZE=128, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, HAS_SPLIT=True, NUM_STAGES=2, ASM=True,
                       DOT_DTYPE=tl.float16, DOT_PREC="tf32"), 4, 2),
    "w4a16_gemv": (w4a16_gemv._gemv_kernel, {"qw_ptr": _I32, "z_ptr": "*u8", "part_ptr": _F32, "cnt_ptr": _I32}, {},
                   dict(GROUP_SIZE=128, BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, HAS_SPLIT=True, NUM_STAGES=2, ASM=True),
                   4, 2),
    "w4a16_dequant": (w4a16_dequant._dequant_kernel, {"qw_ptr": _I32, "z_ptr": "*u8"}, {},
                      dict(GROUP_SIZE=128, BLOCK_N=32, BLOCK_K=256), 8, 1),
}


def check(name: str, pdl: bool) -> dict:
    """Compile kernel ``name`` with ``PDL=pdl``; SASS positions of the wait, the trigger and
    the first global-memory instruction (instruction indices; -1 when absent)."""
    fn, ptrs, scalars, constexprs, warps, stages = KERNELS[name]
    types = {a: ptrs.get(a, _F16) for a in fn.arg_names if a.endswith("_ptr")}
    types.update(scalars)
    lines, _ = _sass(_compile(fn, types, dict(constexprs, PDL=pdl), warps, stages))
    ops = [m.group(1) for m in map(_OP.match, lines) if m]
    kinds = [(i, _MEM.match(line).group(1)) for i, line in enumerate(l for l in lines if _OP.match(l))
             if _MEM.match(line)]
    mem = [i for i, _ in kinds]
    find = lambda op: next((i for i, o in enumerate(ops) if o.startswith(op)), -1)  # noqa: E731
    wait = find("ACQBULK")
    writes = [i for i, k in kinds if k not in ("LDG", "LD", "LDGSTS", "UTMALDG", "UBLKPF")]
    return {"wait": wait, "trigger": find("PREEXIT"), "first_global": mem[0] if mem else -1,
            "first_write": writes[0] if writes else -1, "loads_before_wait": sum(1 for i in mem if i < wait),
            "instructions": len(ops)}


def main(argv: list[str]) -> None:
    names = argv or list(KERNELS)
    out = {name: check(name, True) for name in names}
    for name in ("rms_norm", "w4a16_gemv2"):
        if name in names:
            out[name + ":off"] = check(name, False)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
