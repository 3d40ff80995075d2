#!/usr/bin/env bash
# One H200 device call (about 10 minutes for all three parts; pass the parts, e.g. `tests decode`
# in one call and `lm_head` in the next); record the numbers in docs/benchmarks.md.
#
#   bash benchmarks/pending_checks.sh [tests] [decode] [lm_head]   # repository root; $OUT/*.log
#
# 1. kernel tests at real sizes: float32 output of the W4A16 GEMM (quantized LM head), decode
#    attention, PDL order in SASS;
# 2. batch-1 decode, Llama-3.1-8B shape, fresh process each: bf16, int4, int4 with the LM head
#    quantized (`kiln build --quantize-lm-head`), and bf16 / int4 without PDL;
# 3. the W4A16 sweep at the LM head's shape (128256 x 4096, float32 out) vs bf16 cuBLAS, for its
#    tuning-table entries.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-pending}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=" ${*:-tests decode lm_head} "
if [[ $parts == *" tests "* ]]; then
timeout 240 python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels -rfE \
    tests/kernels/test_w4a16.py tests/kernels/test_paged_attention.py tests/kernels/test_pdl.py \
    -k "float32_output or pdl or gpu_decode" > "$OUT/tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.log"
tail -5 "$OUT/tests.log"
fi
if [[ $parts == *" decode "* ]]; then
for m in bf16 int4 int4-lmhead; do
    timeout 150 python3 benchmarks/decode_steps.py "$m" --profile 2>&1 | tail -2 | tee -a "$OUT/decode.log"
done
for m in bf16 int4; do
    timeout 150 python3 benchmarks/decode_steps.py "$m-nopdl" 2>&1 | tail -1 \
        | sed 's/^/nopdl /' | tee -a "$OUT/decode.log"
done
fi
if [[ $parts == *" lm_head "* ]]; then
timeout 300 python3 benchmarks/gpu_bench.py --only w4a16 --shapes lm_head --ms 1,2,4 \
    --json "$OUT/lm_head.json" > "$OUT/lm_head.log" 2>&1
echo "gpu_bench rc=$?" >> "$OUT/lm_head.log"
tail -8 "$OUT/lm_head.log"
fi
