#!/usr/bin/env bash
# GPU checks of changes that were made while no device time was left (session 10, 2026-12-01;
# run in session 11, results in docs/benchmarks.md "Session 11"):
# run it on one H200 through `device` (all three parts take about 10 minutes, more than one call
# may run: pass the parts, e.g. `tests decode` in one call and `lm_head` in the next), then record
# the numbers in docs/benchmarks.md and decide the defaults they were waiting for.
#
#   bash tests/gpu/pending_checks.sh [tests] [decode] [lm_head]   # repository root; $OUT/*.log
#
# 1. kernel tests of the new paths at real sizes: float32 output of the W4A16 GEMM (quantized
#    LM head), decode attention with the split merge fused into the launch, PDL order in SASS;
# 2. batch-1 decode, Llama-3.1-8B shape, fresh process each: bf16, int4, int4 with the LM head
#    quantized (`kiln build --quantize-lm-head`), and bf16 / int4 with KILN_ATTN_FUSED_MERGE=1
#    (flip tuning.ATTENTION["decode"]["fused_merge"] to True if it wins);
# 3. the W4A16 sweep at the LM head's shape (128256 x 4096, float32 out) vs bf16 cuBLAS, to add
#    its TUNED entries.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-pending}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/runtime:$PWD/kernels:$PWD/operator" PYTHONUNBUFFERED=1
parts=" ${*:-tests decode lm_head} "
if [[ $parts == *" tests "* ]]; then
timeout 240 python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels -rfE \
    tests/kernels/test_w4a16.py tests/kernels/test_paged_attention.py tests/kernels/test_pdl.py \
    -k "float32_output or fused_merge or pdl or gpu_decode" > "$OUT/tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.log"
tail -5 "$OUT/tests.log"
fi
if [[ $parts == *" decode "* ]]; then
for m in bf16 int4 int4-lmhead; do
    timeout 150 python3 tests/gpu/decode_steps.py "$m" --profile 2>&1 | tail -2 | tee -a "$OUT/decode.log"
done
for m in bf16 int4; do
    KILN_ATTN_FUSED_MERGE=1 timeout 150 python3 tests/gpu/decode_steps.py "$m" 2>&1 | tail -1 \
        | sed 's/^/fused_merge /' | tee -a "$OUT/decode.log"
done
fi
if [[ $parts == *" lm_head "* ]]; then
timeout 300 python3 -m kiln.runtime.quantization.gpu_bench --only w4a16 --shapes lm_head --ms 1,2,4 \
    --json "$OUT/lm_head.json" > "$OUT/lm_head.log" 2>&1
echo "gpu_bench rc=$?" >> "$OUT/lm_head.log"
tail -8 "$OUT/lm_head.log"
fi
