#!/usr/bin/env bash
# The serving path against the offline engine on one GPU (issue: the serving path is the
# product).  Run through the device tool from the repository root, with the wheels the GPU
# image lacks in .whl/ (fastapi, starlette, pydantic, uvicorn, pyzmq, msgspec, ...):
#   bash benchmarks/serving_h200.sh [quick]
# Writes $OUT/*.json and prints one summary line per run.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-serving}
mkdir -p "$OUT"
W=$(mktemp -d)  # per-run samples (not returned)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/runtime:$PWD/kernels:$PWD/common:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
K="python3 -m kiln.runtime.cli --log-level WARNING"
# N, IN, OUTLEN, SEQS, QUANT (weights at load), KV (--kv-cache-dtype), FRACTION from the environment;
# THROUGHPUT_ONLY=1 skips the batch-1 and concurrency-1 runs
MODEL=builtin:llama-3.1-8b; N=${N:-512}; IN=${IN:-1000}; OUTLEN=${OUTLEN:-1000}; SEQS=${SEQS:-256}
if [ "${1:-}" = quick ]; then MODEL=builtin:llama-3.2-1b; N=64; IN=200; OUTLEN=100; SEQS=64; fi
Q=${QUANT:-none}
ENG="--model $MODEL --load-format dummy --max-num-seqs $SEQS --max-num-batched-tokens 4096 --kv-cache-memory-fraction ${FRACTION:-0.9} --kv-cache-dtype ${KV:-auto}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# offline first: the reference of every HTTP run below (a call cut short keeps it);
# SKIP_OFFLINE=1 when an earlier call on the same machine measured it
if [ -z "${SKIP_OFFLINE:-}" ]; then
echo "== offline $Q: $N x $IN/$OUTLEN"
$K bench offline $ENG --quantization $Q --num-prompts $N --input-len $IN --output-len $OUTLEN --json $OUT/offline.json \
  2>&1 | tail -3
[ -z "${THROUGHPUT_ONLY:-}" ] && echo "== offline batch 1: 2 x $IN/512" && \
$K bench offline --model $MODEL --load-format dummy --max-num-seqs 1 --quantization $Q --num-prompts 2 \
  --input-len $IN --output-len 512 --json $OUT/offline_b1.json 2>&1 | tail -3
fi
for API in ${APIS:-1 2}; do
  echo "== serve (api-server-count $API) + bench serve"
  $K serve $ENG --quantization $Q --host 127.0.0.1 --port 8011 --api-server-count $API > $OUT/serve_$API.log 2>&1 &
  SP=$!
  for i in $(seq 1 300); do curl -sf 127.0.0.1:8011/ready > /dev/null && break; sleep 1; done
  curl -sf 127.0.0.1:8011/ready || { tail -30 $OUT/serve_$API.log; kill $SP; exit 1; }
  echo
  # where the time goes: every server process's CPU seconds around the run, and the running
  # batch (the core's gauge) sampled each second during it
  cpu() { curl -s 127.0.0.1:8011/metrics | grep '^kiln_process_cpu_seconds' | sed 's/.*process="\([^"]*\)".* /\1 /'; }
  cpu > $W/cpu0_$API; t0=$(date +%s.%N)
  ( while sleep 1; do curl -s 127.0.0.1:8011/metrics | grep '^kiln_num_requests_running' | awk '{print $NF}'; done ) \
    > $W/running_$API.txt 2>/dev/null &
  RP=$!
  $K bench serve --url http://127.0.0.1:8011 --num-prompts $N --input-len $IN --output-len $OUTLEN \
    --range-ratio 0 --max-concurrency $SEQS --json $OUT/serve_c${SEQS}_api$API.json 2>&1 | tail -4
  t1=$(date +%s.%N); kill $RP; sleep 2.5; cpu > $W/cpu1_$API
  python3 - $W $API $t0 $t1 <<'PY'
import sys, pathlib
o, api, t0, t1 = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
def cpu(n): return {l.split()[0]: float(l.split()[1]) for l in (o / n).read_text().splitlines() if l.strip()}
c0, c1 = cpu(f"cpu0_{api}"), cpu(f"cpu1_{api}")
run = [float(x) for x in (o / f"running_{api}.txt").read_text().split()]
busy = [x for x in run if x > 0]
print("  server CPU share:", {k: round((c1[k] - c0.get(k, 0)) / (t1 - t0), 2) for k in c1},
      f"running batch mean {sum(busy) / max(1, len(busy)):.0f} over {len(busy)} s")
PY
  grep -iE "error|exception|traceback" $OUT/serve_$API.log | head -5
  if [ $API = 1 ] && [ -z "${THROUGHPUT_ONLY:-}" ]; then
    $K bench serve --url http://127.0.0.1:8011 --num-prompts 16 --input-len $IN --output-len 256 \
      --range-ratio 0 --max-concurrency 1 --json $OUT/serve_c1.json 2>&1 | tail -4
  fi
  kill -TERM $SP; wait $SP
  echo "serve exit $?"
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
keys = ("output_tok_s", "ttft_p50_s", "tpot_p50_s", "itl_p50_s", "errors", "first_error", "client_cpu_share",
        "wall_s", "output_tokens")
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(p.read_text())
    for r in d.get("results", [d]):
        print(p.name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in keys})
PY
