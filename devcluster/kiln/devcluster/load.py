"""Clients for the end-to-end tests: a request loop that counts failures (rollouts) and a load
generator (autoscaling).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx



def chat(base_url: str, content: str, max_tokens: int = 16, model: str | None = None,
         timeout: float = 120, client: httpx.Client | None = None, api_key: str | None = None) -> str:
    """One chat completion over a fresh connection (no keep-alive: each request is routed anew,
    as a new TCP connection through kube-proxy would be), with ``api_key`` as the bearer token
    when given.  Raises on any failure."""
    body = {"model": model or "default", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    headers = {"Connection": "close"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    r = (client or httpx).post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout, headers=headers)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


@dataclass
class ClientLoop:
    """Sequential requests in a thread until ``stop()``; every non-2xx or transport error counts
    as a failure (no retries)."""

    base_url: str
    model: str | None = None
    max_tokens: int = 8
    api_key: str | None = None
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
                chat(self.base_url, "Name a colour.", self.max_tokens, self.model, timeout=60, api_key=self.api_key)
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


