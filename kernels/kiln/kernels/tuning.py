"""Launch configurations for Kiln's kernels: data only, read by ``launch.py``.

Each entry is a plain dict of Triton meta-parameters.  Numbers in comments were measured on
one NVIDIA H200 (see docs/benchmarks.md, "Kernels"); ``bench.py --sweep`` re-measures them.
The ``"interpreter"`` entries keep ``TRITON_INTERPRET=1`` runs on the CPU small and quick.
"""

# Paged attention.  BLOCK_N: KV tokens per inner-loop tile; BLOCK_M: query rows per program
# (query tokens x query heads of one KV head); num_warps / num_stages: Triton's.
ATTENTION = {
    # decode: one query token per sequence, all G query heads of a KV head in one program
    # H200, B64 ctx4096 Hq32 Hkv8 D128 bf16, 2 splits: 267 us = 94.5% of copy BW; the same
    # with num_stages=3: 320 us (78.8%); BLOCK_N=128: 297 us; num_warps=8: 361 us.
    # "kernel": "mma" (tensor-core tl.dot, attention._paged_attn_kernel) or "cuda_core"
    # (FMA dot products, decode_attention.py; its launch parameters are the "*_cuda_core" entry).
    # "fused_merge" (the splits merged in the decode launch, attention.py): measured off
    # (session 11, batch-1 decode of the 8B shape, GPU span per step: bf16 4.142 vs 4.084 ms,
    # int4 2.359 vs 2.246 ms without it; tests/gpu/pending_checks.sh decode).
    "decode": {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    # decode over a float8_e4m3fn cache (bf16 queries): B64 ctx4096: 251 us, B256 ctx1536:
    # 378 us (50% of copy BW: as fast as the bf16 cache per token, not per byte); products in
    # float16 (fp8_f16_dot) beat bf16 products by 10-25%.  Tried without gain (2026-11-30):
    # converting in registers with inline PTX before the shared-memory round trip (252-395 us
    # over BLOCK_N 64-256, stages 1-2, 4/8 warps), V stored token-contiguous (569 us).
    # 2026-12-01, B384 contexts 1,000-2,000 (tests/gpu/attn_sweep.py --fp8 --occupancy): a
    # register cap of 168 (200 uncapped) gives 447 us = 63.5% of copy BW vs 522 us (54.3%);
    # cap 128: 460 us; BLOCK_N 64: 508 us.  The CUDA-core kernel: 619 us at best.
    # 2026-12-01 (session 5): V read as int32 words ("fp8_words": 2, attention.py): Triton 3.6
    # otherwise loads the fp8 V operand from shared memory one byte per LDS (V is d-contiguous,
    # the P @ V product pairs tokens); as words, 16-byte loads and 2 cvt per word (offline SASS:
    # 42.8 -> 30.1 warp-instructions per (token, KV head), 200 -> 156 registers).  attn_sweep.py
    # --fp8 --words: B384 447 -> 359 us (78.5% of copy BW), B512 466 us (80.2%); bytes vs words
    # at the best config of each: 445.6 vs 354.5 us.  K as words too (3): no gain (359-385 us);
    # BLOCK_N 256: 530-800 us; 8 warps: 560-1040 us; 2 splits: +5-10%.
    "decode_fp8": {"kernel": "mma", "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "fp8_f16_dot": True,
                   "fp8_words": 2, "maxnreg": 128},
    # the CUDA-core decode kernel (decode_attention.py): BLOCK_N tokens per tile, split into
    # num_warps warps with their own online-softmax state.  H200 (bench.py --decode-variants,
    # 2026-12-01): slower than the mma kernel at every shape measured, bf16 and fp8 (B384
    # ctx1500 fp8: best 619 us vs 508; bf16: 743 vs 563); to use it set "kernel": "cuda_core".
    "decode_cuda_core": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    "decode_fp8_cuda_core": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    # prefill / chunked prefill / mixed batches.  H200, 4 x 2048-token prompts, bf16:
    # 230 TFLOP/s; BLOCK_M=64/BLOCK_N=64: 192; BLOCK_M=128/BLOCK_N=64/8 warps: 220.
    "prefill": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    "interpreter": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1},
}

# Flash-decoding split count (launch.decode_num_splits): the largest power of two <=
# (SMs * programs_per_sm) / (num_seqs * num_kv_heads), at least min_splits, at most
# max_splits, and no split shorter than min_tokens_per_split when the caller passes a
# max_seq_len.  H200 (BLOCK_N 64, 4 warps, 2 stages; % of copy BW):
#   B64 ctx4096: 1 split 71%, 2 -> 96.4%, 3 -> 96.6%, 4 -> 95.7%, 8 -> 92.3%
#   B256 ctx1024: 1 -> 87.5%, 2 -> 91.0%, 4 -> 87.6%;  B8 ctx8192: 8 -> 87.0%, 9 -> 76.8%, 16 -> 84.1%
#   B1 ctx4096: 16 -> 15.5 us, 32 -> 13.2 us (latency-bound: 16 MB)
#   Contexts spread over 1,000-2,000 tokens (the 1000/1000 run; tests/gpu/attn_sweep.py,
#   2026-12-01): B384: 1 split 591 us = 95.1%, 2 -> 611 us (92.0%); B256: 1 -> 407 us (91.8%),
#   2 -> 415 us: once num_seqs x num_kv_heads >= 8 programs per SM, one split.
DECODE_SPLIT = {"programs_per_sm": 4, "min_splits": 2, "max_splits": 32, "min_tokens_per_split": 128,
                "single_split_programs_per_sm": 8}

# Row-wise kernels (RMSNorm, rotary, KV write): warps by the row's element count.
ROW_WARPS = [(1024, 4), (4096, 8), (1 << 30, 16)]

# Element-wise kernels (SiLU-and-mul): elements per program along the row.
ELEMENTWISE = {"BLOCK": 1024, "num_warps": 4}

# SMs assumed when no CUDA device is visible (the H200 has 132).
DEFAULT_NUM_SMS = 132
