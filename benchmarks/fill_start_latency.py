"""How long a bitmask fill handed to its worker thread waits to start while the step loop
runs Python, at CPython's default switch interval and at the one a ``BitmaskFiller`` sets.

The step loop starts a step's fill, then hands out the previous step's outputs and plans the
next step (Python, holding the interpreter lock) before it waits for the mask.  The worker
can run only once it holds the lock, so its start is delayed until the step loop blocks or
the switch interval forces a hand-over.  This script submits a no-op task (the fill's
Python prologue) to a one-thread pool, keeps the main thread in pure Python for
``--busy-ms``, and prints the median and p90 delay from submit to the task's start:

    .venv/bin/python benchmarks/fill_start_latency.py --busy-ms 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def _busy(ms: float) -> int:
    end = time.perf_counter() + ms / 1e3
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def start_delays(interval_s: float, busy_ms: float, reps: int) -> list[float]:
    """Seconds from submit to the worker's first line, ``reps`` times, at ``interval_s``."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(time.perf_counter).result()  # the thread exists
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fut = pool.submit(time.perf_counter)
                _busy(busy_ms)
                out.append(fut.result() - t0)
            return out
    finally:
        sys.setswitchinterval(old)


def main(argv: list[str] | None = None) -> int:
    from kiln.runtime.structured_output.bitmask import FILL_SWITCH_INTERVAL_S

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy-ms", type=float, default=3.0, help="Python work after the submit (ms)")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args(argv)
    for name, iv in (("CPython default", 0.005), ("BitmaskFiller", FILL_SWITCH_INTERVAL_S)):
        d = sorted(start_delays(iv, a.busy_ms, a.reps))
        print(f"{name:16s} switch interval {iv * 1e3:5.2f} ms: start delay median "
              f"{1e3 * statistics.median(d):.3f} ms, p90 {1e3 * d[int(0.9 * len(d))]:.3f} ms "
              f"(main thread busy {a.busy_ms:g} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
