#!/usr/bin/env bash
# One device call: the kernel tests at real sizes on the GPU, then the benchmark.
# Usage (repository root, on the GPU machine): bash benchmarks/device_run.sh [--sweep]
set -uo pipefail
OUT=${OUT:-/tmp/kiln-kernels-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/smi.txt" 2>&1
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)' >> "$OUT/smi.txt"
# --confcutdir: only tests/kernels/conftest.py (the repo-root conftest needs cluster tooling)
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -n "${TEST_WORKERS:-8}" -p no:cacheprovider \
    --confcutdir=tests/kernels tests/kernels -rfE --durations=8 > "$OUT/tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/kernel_bench.py "$@" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=$?"
tail -25 "$OUT/tests.log"
