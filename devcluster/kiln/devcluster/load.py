"""Clients for the end-to-end tests: a request loop that counts failures (rollouts), a load
generator (autoscaling), and a feeder that turns the serving pods' real ``/metrics`` into the
test custom-metrics API's pods metric (what prometheus-adapter does in a real cluster).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass, field

import httpx

QUEUE_METRIC = "kiln_request_queue_time_seconds"


def chat(base_url: str, content: str, max_tokens: int = 16, model: str | None = None,
         timeout: float = 120, client: httpx.Client | None = None) -> str:
    """One chat completion over a fresh connection (no keep-alive: each request is routed anew,
    as a new TCP connection through kube-proxy would be).  Raises on any failure."""
    body = {"model": model or "default", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    r = (client or httpx).post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout,
                               headers={"Connection": "close"})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


@dataclass
class ClientLoop:
    """Sequential requests in a thread until ``stop()``; every non-2xx or transport error counts
    as a failure (no retries)."""

    base_url: str
    model: str | None = None
    max_tokens: int = 8
    num_ok: int = 0
    num_failed: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="client-loop")

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                chat(self.base_url, "Name a colour.", self.max_tokens, self.model, timeout=60)
                self.num_ok += 1
                self.latencies.append(time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - counted
                self.num_failed += 1
                self.errors.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}"[:300])
                time.sleep(0.2)

    def start(self) -> "ClientLoop":
        self._thread.start()
        return self

    def stop(self) -> "ClientLoop":
        self._stop.set()
        self._thread.join(timeout=90)
        return self


@dataclass
class Load:
    """``concurrency`` threads sending long-ish completions back to back until ``stop()``."""

    base_url: str
    concurrency: int = 12
    max_tokens: int = 64
    model: str | None = None
    num_ok: int = 0
    num_failed: int = 0

    def __post_init__(self):
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"load-{i}")
                         for i in range(self.concurrency)]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                chat(self.base_url, "Write a long story about a dragon and a kiln.", self.max_tokens, self.model,
                     timeout=300)
                self.num_ok += 1
            except Exception:  # noqa: BLE001
                self.num_failed += 1
                time.sleep(0.5)

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> "Load":
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        return self


def scrape(pod_ip: str, port: int = 8000, timeout: float = 3) -> str:
    with urllib.request.urlopen(f"http://{pod_ip}:{port}/metrics", timeout=timeout) as r:
        return r.read().decode("utf-8", errors="replace")


class MetricsFeeder:
    """Every ``interval`` s: scrape each running pod of ``selector`` (``/metrics``), compute its
    mean queue time over the interval from the histogram's ``_sum``/``_count`` deltas (what
    prometheus-adapter's rate() rule serves), and feed it as the pods metric
    ``kiln_request_queue_time_seconds`` of the test custom-metrics API."""

    def __init__(self, stack, namespace: str, selector: str, interval: float = 2.0):
        from kiln.operator.autoscaler import mean_over_interval, parse_histogram
        self._parse, self._mean = parse_histogram, mean_over_interval
        self.stack, self.namespace, self.selector, self.interval = stack, namespace, selector, interval
        self.prev: dict[str, object] = {}
        self.fed: dict[str, float] = {}
        self.num_scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="metrics-feeder")

    def tick(self) -> None:
        cm = self.stack.plane.custom_metrics
        for pod in self.stack.pods(self.namespace, self.selector):
            name, ip = pod["metadata"]["name"], (pod.get("status") or {}).get("podIP")
            if not ip or pod["metadata"].get("deletionTimestamp"):
                continue
            try:
                totals = self._parse(scrape(ip))
            except Exception:  # noqa: BLE001 - not serving yet
                continue
            if totals is None:
                continue
            self.num_scrapes += 1
            mean = self._mean(self.prev.get(name), totals)
            self.prev[name] = totals
            value = 0.0 if mean is None else mean
            cm.set(self.namespace, name, QUEUE_METRIC, value)
            self.fed[name] = value

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001
                pass

    def start(self) -> "MetricsFeeder":
        self.tick()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
