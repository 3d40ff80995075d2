"""Start and stop a real `kiln serve` process on a free port (embedded default model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from kiln.runtime.demo import free_port, wait_ready


@dataclass
class Server:
    base: str
    proc: subprocess.Popen
    api_key: str | None = None

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    def metrics(self) -> dict[str, float]:
        """Parse /metrics into {'name{labels}': value}."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.rpartition(" ")
                out[key] = float(val)
        return out

    def log_text(self) -> str:
        """What the server process wrote to its log so far."""
        with open(f"/tmp/kiln-serve-{self.base.rsplit(':', 1)[1]}.log") as f:
            return f.read()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``."""
        total = 0.0
        for key, val in self.metrics().items():
            base = key.split("{", 1)[0]
            if base != name:
                continue
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += val
        return total


def start_server(*extra: str, api_key: str | None = None, new_session: bool = False) -> Server:
    """``kiln serve`` on a free port; ``new_session`` puts it in its own process group (tests
    that signal the whole group)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if api_key:
        env["KILN_API_KEY"] = api_key
    log = open(f"/tmp/kiln-serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kiln.runtime.cli", "--log-level", "WARNING", "serve",
                             "--host", "127.0.0.1", "--port", str(port), *extra],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout_s=600)
    except Exception:
        proc.kill()
        raise RuntimeError(open(log.name).read()[-4000:])
    return Server(base, proc, api_key)


def stop_server(s: Server) -> None:
    s.proc.terminate()
    try:
        s.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        s.proc.kill()
