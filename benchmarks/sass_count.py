"""Count SASS instructions in the inner loop of the decode attention kernel, offline (no GPU).

Usage (from the repository root; needs only Triton's bundled ptxas/nvdisasm)::

    python3 benchmarks/sass_count.py [--cache fp8|bf16] [--G 4] [--D 128] [--num-warps 4]
        [--mma-block-n 128] [--mma-stages 3] [--splits 2] [--fp8-v-words] [--dump DIR]
    python3 benchmarks/sass_count.py --gemv2 32,2048,4,1   # W4A16 gemv2 instead

Compiles ``attention._paged_attn_kernel`` in decode mode (``mma``) for sm_90 with the launch
parameters given, disassembles the cubin with ``nvdisasm`` and reports, for the largest
loop (the steady-state tile loop: the block whose last instruction branches backwards to
its first), the instructions per iteration, per (token, KV head) (divided by BLOCK_N and
multiplied by the warps of a program: every warp issues its own copy) and a histogram of
opcodes.  Budget on the H200 (fp8, G = 4, D = 128): one (token, KV head) pair = 256 bytes
of K + V; at 4.8 TB/s over 132 SMs at 1.98 GHz an SM must finish one every ~15 cycles,
i.e. at most ~60 warp-instructions (4 issue slots per cycle), the fewer the better.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from kiln.kernels.attention import _paged_attn_kernel

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int):
    """Compile ``fn`` with argument types ``types`` (name -> Triton type string); pointers and
    integer arguments named ``stride_*`` get ``tt.divisibility = 16`` (as Triton specializes
    them at launch for 16-aligned tensors)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        t = types.get(name, "i32")
        sig[name] = t
        if t.startswith("*") or (name.startswith("stride") and t == "i32"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=_TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def _sass(kernel) -> tuple[list[str], str]:
    """(SASS lines, resource usage line: registers, spills, shared memory) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([os.path.join(_BIN, "nvdisasm"), "-c", "-g", f.name], check=True,
                             capture_output=True, text=True).stdout
        res = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    usage = next((l.strip() for l in res.splitlines() if "REG:" in l), "?")
    return out.splitlines(), usage


_INSTR = re.compile(r"^\s*(?:/\*[0-9a-f]+\*/\s*)?(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\b.*;")
_LABEL = re.compile(r"^\s*\.?(L_x_\d+|\.L_\w+):")
_BRA = re.compile(r"\bBRA\b.*?`?\(?\.?(L_x_\d+)")


def inner_loop(lines: list[str]) -> tuple[int, collections.Counter]:
    """Instructions of the largest backward-branch loop (label .. branch back), and their opcodes."""
    labels, instrs = {}, []
    for line in lines:
        m = _LABEL.match(line)
        if m:
            labels[m.group(1).lstrip(".")] = len(instrs)
            continue
        m = _INSTR.match(line)
        if m:
            instrs.append((m.group(1), line))
    best = (0, 0, 0)
    for i, (op, line) in enumerate(instrs):
        b = _BRA.search(line)
        if op == "BRA" and b and b.group(1) in labels and labels[b.group(1)] <= i:
            start = labels[b.group(1)]
            if i + 1 - start > best[0]:
                best = (i + 1 - start, start, i + 1)
    ops = collections.Counter(op.split(".")[0] for op, _ in instrs[best[1]:best[2]])
    return best[0], ops


def _common_types(cache: str, qdtype: str) -> dict:
    c = {"fp8": "*fp8e4nv", "bf16": "*bf16", "fp16": "*fp16"}[cache]
    return {"q_ptr": f"*{qdtype}", "out_ptr": f"*{qdtype}", "k_cache_ptr": c, "v_cache_ptr": c,
            "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_ptr": "*i32",
            "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "k_scale_val": "fp32", "v_scale_val": "fp32",
            "sm_scale": "fp32", "k_scale_stride": "i32", "v_scale_stride": "i32", "num_seqs": "i32",
            "cnt_ptr": "*i32"}


def count_mma(cache="fp8", G=4, D=128, block_n=128, num_warps=4, num_stages=3, splits=2, block_size=16,
              dump=None, fp8_v_words=False) -> dict:
    scale_mode = 1 if cache == "fp8" else 0
    k = _compile(_paged_attn_kernel, _common_types(cache, "bf16"),
                 dict(HEAD_DIM=D, BLOCK_SIZE=block_size, G=G, BLOCK_Q=1, BLOCK_M=max(16, triton.next_power_of_2(G)),
                      BLOCK_N=block_n, BLOCK_D=D, NUM_SPLITS=splits, IS_DECODE=True, PART_STRIDE=D + 4,
                      K_SCALE_MODE=scale_mode, V_SCALE_MODE=scale_mode, DOT_PREC="tf32",
                      F16_DOT=cache == "fp8", V_WORDS=fp8_v_words and cache == "fp8",
                      CVT_PTX=fp8_v_words and cache == "fp8"), num_warps, num_stages)
    return _report("mma", k, block_n, num_warps,
                   dict(cache=cache, G=G, D=D, num_stages=num_stages, fp8_v_words=fp8_v_words, splits=splits), dump)


def count_gemv2(block_n=32, block_k=2048, num_warps=4, prefetch=1, group_size=128, block_m=1, split=False) -> dict:
    """SASS of ``w4a16._gemv2_kernel`` (bf16 x, unit column strides as launched): registers,
    global load widths in the whole kernel, and the steady-state loop's instructions per step
    and per weight and thread (``BLOCK_N * BLOCK_K / (32 num_warps)`` weights per thread)."""
    from kiln.kernels.w4a16.gemv2 import _gemv2_kernel

    types = {a: "*bf16" for a in _gemv2_kernel.arg_names if a.endswith("_ptr")}
    types.update({"xw_ptr": "*i64", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "part_ptr": "*fp32",
                  "cnt_ptr": "*i32"})
    ones = {n: 1 for n in ("stride_qn", "stride_sn", "stride_zn", "stride_on")}  # specialized at launch
    k = _compile(_gemv2_kernel, types,
                 dict(ones, GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, CHAIN=8,
                      HAS_SPLIT=split, NUM_STAGES=1, X_BF16=True, ASM=True, EVEN_K=True, EVEN_N=True, EVEN_M=True,
                      PDL=True, PREFETCH=prefetch), num_warps, 1)
    lines, usage = _sass(k)
    n, ops = inner_loop(lines)
    loads = collections.Counter(m.group(1) for m in map(_INSTR.match, lines) if m and m.group(1).startswith("LDG"))
    per_thread = block_m * block_n * block_k / (32 * num_warps)
    return {"kernel": "gemv2", "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": num_warps, "PREFETCH": prefetch,
            "resources": usage, "loop_instrs_per_warp": n, "instrs_per_weight_per_thread": n / per_thread,
            "global_loads": dict(loads), "top_ops": ops.most_common(10)}


def _report(name, kernel, block_n, warps, info, dump) -> dict:
    lines, usage = _sass(kernel)
    n, ops = inner_loop(lines)
    if dump:
        os.makedirs(dump, exist_ok=True)
        tag = f"{name}_{info['cache']}_G{info['G']}_N{block_n}_w{warps}"
        with open(os.path.join(dump, tag + ".sass"), "w") as f:
            f.write("\n".join(lines))
        with open(os.path.join(dump, tag + ".ttgir"), "w") as f:
            f.write(kernel.asm["ttgir"])
    per_tok = n * warps / block_n
    return {"kernel": name, **info, "BLOCK_N": block_n, "num_warps": warps, "loop_instrs_per_warp": n,
            "warp_instrs_per_token_kvhead": per_tok, "resources": usage,
            "top_ops": ops.most_common(14)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default="fp8", choices=["fp8", "bf16", "fp16"])
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=2)
    ap.add_argument("--dump", default=None, help="write the SASS and TTGIR here")
    ap.add_argument("--mma-block-n", type=int, default=128, help="BLOCK_N of the mma kernel")
    ap.add_argument("--mma-stages", type=int, default=3, help="num_stages of the mma kernel")
    ap.add_argument("--fp8-v-words", action="store_true", help="fp8 cache: V read as int32 words")
    ap.add_argument("--splits", type=int, default=2, help="decode context splits (NUM_SPLITS)")
    ap.add_argument("--gemv2", default=None, metavar="BN,BK,WARPS,PREFETCH",
                    help="instead: the W4A16 gemv2 kernel at this config (e.g. 32,2048,4,1, the qkv M = 1 TUNED one)")
    a = ap.parse_args(argv)
    if a.gemv2:
        try:
            bn, bk, w, pf = (int(v) for v in a.gemv2.split(","))
        except ValueError:
            ap.error(f"--gemv2 wants four integers BN,BK,WARPS,PREFETCH, got {a.gemv2!r}")
        print(json.dumps(count_gemv2(bn, bk, w, pf)))
        return
    rows = [count_mma(a.cache, a.G, a.D, a.mma_block_n, a.num_warps, a.mma_stages, a.splits, dump=a.dump,
                      fp8_v_words=a.fp8_v_words)]
    for r in rows:
        print(f"{r['kernel']:9s} {r['cache']} G{r['G']} D{r['D']} BLOCK_N={r['BLOCK_N']} warps={r['num_warps']} "
              f"stages={r['num_stages']}: {r['loop_instrs_per_warp']} instrs/iteration/warp -> "
              f"{r['warp_instrs_per_token_kvhead']:.1f} warp-instrs per (token, kv head)\n    {r['resources']}\n    {r['top_ops']}")


if __name__ == "__main__":
    main()
