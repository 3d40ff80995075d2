#!/usr/bin/env bash
# Where the HTTP path loses throughput against offline: one `kiln serve` (8B shape, bf16,
# dummy weights), then (a) one `kiln bench serve` client at concurrency 256 and (b) two
# clients at 128 each in parallel, with every server process's CPU seconds read from
# /metrics around each run.  Run through the device tool with .whl carried (see serving_h200.sh).
set -uo pipefail
OUT=${OUT:-/tmp/kiln-probe}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/runtime:$PWD/kernels:$PWD/common:/tmp/site PYTHONUNBUFFERED=1
K="python3 -m kiln.runtime.cli --log-level WARNING"
API=${API:-1}
$K serve --model builtin:llama-3.1-8b --load-format dummy --max-num-seqs 256 --max-num-batched-tokens 4096 \
  --kv-cache-memory-fraction 0.9 --host 127.0.0.1 --port 8011 --api-server-count $API > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 300); do curl -sf 127.0.0.1:8011/ready > /dev/null && break; sleep 1; done
cpu() { sleep 2.5; curl -s 127.0.0.1:8011/metrics | grep '^kiln_process_cpu_seconds' | sed 's/.*process="\([^"]*\)".* /\1 /'; }
B="$K bench serve --url http://127.0.0.1:8011 --input-len 1000 --output-len 1000 --range-ratio 0"
cpu > $OUT/cpu0; t0=$(date +%s.%N)
$B --num-prompts 512 --max-concurrency 256 --json $OUT/one.json 2>/dev/null | tail -1
t1=$(date +%s.%N); cpu > $OUT/cpu1
$B --num-prompts 256 --max-concurrency 128 --seed 1 --json $OUT/two_a.json > /dev/null 2>&1 &
PA=$!
$B --num-prompts 256 --max-concurrency 128 --seed 2 --json $OUT/two_b.json > /dev/null 2>&1 &
PB=$!
wait $PA $PB
t2=$(date +%s.%N); cpu > $OUT/cpu2
kill -TERM $SP; wait $SP
python3 - "$OUT" "$t0" "$t1" "$t2" <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1]); t0, t1, t2 = map(float, sys.argv[2:])
def cpu(n): return {l.split()[0]: float(l.split()[1]) for l in (o / n).read_text().split("\n") if l.strip()}
c0, c1, c2 = cpu("cpu0"), cpu("cpu1"), cpu("cpu2")
one = json.loads((o / "one.json").read_text())["results"][0]
a = json.loads((o / "two_a.json").read_text())["results"][0]; b = json.loads((o / "two_b.json").read_text())["results"][0]
print(f"one client c256: {one['output_tok_s']:.0f} tok/s, TPOT p50 {one['tpot_p50_s']*1e3:.1f} ms, wall {t1-t0:.1f} s")
print("  process CPU share:", {k: round((c1[k] - c0.get(k, 0)) / (t1 - t0), 2) for k in c1})
tot = (a["output_tokens"] + b["output_tokens"]) / (t2 - t1)
print(f"two clients c128+c128: {tot:.0f} tok/s total, TPOT p50 {a['tpot_p50_s']*1e3:.1f}/{b['tpot_p50_s']*1e3:.1f} ms, wall {t2-t1:.1f} s")
print("  process CPU share:", {k: round((c2[k] - c1.get(k, 0)) / (t2 - t1), 2) for k in c2})
PY
