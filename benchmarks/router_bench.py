"""The Kiln router's costs and gains, measured against real `kiln serve` replicas.

    .venv/bin/python benchmarks/router_bench.py [--replicas 2] [--latency-requests 60]
        [--groups 4] [--requests-per-group 8] [--concurrency 4] [--prefix-words 300]
        [--serve-arg=--device=cpu ...] [--json out.json]

Starts ``--replicas`` `kiln serve` processes (the embedded default model unless ``--serve-arg``
names another, served as ``bench``), and `kiln router --backend` processes in front of them, then:

1. Added latency: streamed completions (``max_tokens`` 1, a short unique prompt), one at a
   time, alternating between a replica directly and the same replicas through the router
   (policy least-outstanding), in the same run; TTFT p50 / p99 of each, and the difference.
2. Prefix-cache hit rate: ``--groups`` shared prefixes (``--prefix-words`` words of a system
   prompt each), ``--requests-per-group`` requests per prefix with a unique question, sent in
   a random (seeded) order at ``--concurrency``, through a router with ``--policy prefix`` and again
   (other prefixes, so no run reuses the other's cache) with ``--policy round-robin``; the hit
   rate is the replicas' ``kiln_prefix_cache_hits_total / kiln_prefix_cache_queries_total``
   over each run; the ratio affinity / round-robin is printed.

Cold start 0 -> first token needs the operator scaling a Deployment: it is measured by the
end-to-end test tests/e2e/test_router_e2e.py on the test plane.

Prints one JSON object (also to ``--json``).  Not part of the installed packages.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

MODEL = "bench"
WORDS = ("river mountain lantern copper violet harbor meadow signal orbit canyon ember glacier "
         "pepper saddle tundra willow falcon marble nectar quartz").split()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout} s")


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kiln.runtime.cli", "--log-level", "WARNING", *argv],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def metric(base: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def ttft(client: httpx.Client, base: str, prompt: str, max_tokens: int = 1) -> float:
    """Seconds from sending a streamed completion to its first content chunk."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def latency(replicas: list[str], router: str, n: int) -> dict:
    direct, routed = [], []
    with httpx.Client() as client:
        for base in (*replicas, router):  # warm every path once
            ttft(client, base, "warm up")
        for i in range(n):
            prompt = f"Request {i}: name a colour."
            if i % 2 == 0:
                direct.append(ttft(client, replicas[(i // 2) % len(replicas)], prompt))
            else:
                routed.append(ttft(client, router, prompt))
    ms = lambda x: round(1000 * x, 2)  # noqa: E731
    return {"num_requests_each": len(direct), "direct_ttft_p50_ms": ms(pct(direct, 50)),
            "direct_ttft_p99_ms": ms(pct(direct, 99)), "router_ttft_p50_ms": ms(pct(routed, 50)),
            "router_ttft_p99_ms": ms(pct(routed, 99)),
            "added_p50_ms": ms(pct(routed, 50) - pct(direct, 50)), "added_p99_ms": ms(pct(routed, 99) - pct(direct, 99))}


def prefix_run(replicas: list[str], router: str, groups: int, per_group: int, words: int, concurrency: int,
               seed: int) -> dict:
    rng = random.Random(seed)
    prefixes = [f"System {seed}-{g}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for g in range(groups)]
    prompts = [f"{prefixes[g]}\nQuestion {seed}-{g}-{k}: what is {k} plus {g}?"
               for k in range(per_group) for g in range(groups)]
    rng.shuffle(prompts)  # arrival order at random: a fixed interleave can line up with round robin's turns
    q0 = sum(metric(r, "kiln_prefix_cache_queries_total") for r in replicas)
    h0 = sum(metric(r, "kiln_prefix_cache_hits_total") for r in replicas)
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda p: ttft(client, router, p, max_tokens=2), prompts))
    q = sum(metric(r, "kiln_prefix_cache_queries_total") for r in replicas) - q0
    h = sum(metric(r, "kiln_prefix_cache_hits_total") for r in replicas) - h0
    return {"requests": len(prompts), "prefix_cache_queries": q, "prefix_cache_hits": h,
            "hit_rate": round(h / q, 4) if q else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--latency-requests", type=int, default=60, help="requests per path (direct, router); 0: skip")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--requests-per-group", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `kiln serve` argument (repeatable)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    procs: list[subprocess.Popen] = []
    try:
        replicas = []
        for _ in range(a.replicas):
            port = free_port()
            procs.append(start(["serve", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
                                *a.serve_arg], logs / f"router-bench-serve-{port}.log"))
            replicas.append(f"http://127.0.0.1:{port}")
        routers = {}
        for policy in ("least-outstanding", "prefix", "round-robin"):
            port = free_port()
            procs.append(start(["router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                                "--backend", f"{MODEL}={','.join(replicas)}"], logs / f"router-bench-{policy}.log"))
            routers[policy] = f"http://127.0.0.1:{port}"
        for proc, base in zip(procs, [*replicas, *routers.values()]):
            wait_http(f"{base}/ready", proc, base)
        out: dict = {"replicas": a.replicas, "serve_args": a.serve_arg}
        if a.latency_requests > 0:
            out["latency"] = latency(replicas, routers["least-outstanding"], 2 * a.latency_requests)
        aff = prefix_run(replicas, routers["prefix"], a.groups, a.requests_per_group, a.prefix_words, a.concurrency, 1)
        rr = prefix_run(replicas, routers["round-robin"], a.groups, a.requests_per_group, a.prefix_words,
                        a.concurrency, 2)
        out["prefix_cache"] = {"affinity": aff, "round_robin": rr,
                               "hit_rate_ratio": round(aff["hit_rate"] / rr["hit_rate"], 3)
                               if aff["hit_rate"] and rr["hit_rate"] else None}
        text = json.dumps(out, indent=2)
        print(text)
        if a.json:
            Path(a.json).write_text(text + "\n")
        return 0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
