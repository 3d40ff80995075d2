"""The README's first command (`make demo`): start `kiln serve` on the embedded default,
ask "What is the capital of France?" through the official `openai` client, print the answer,
stop the server."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    """Poll ``/ready`` until 200; raises RuntimeError if the server exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"{base}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"kiln serve not ready after {timeout_s:.0f}s")


def main() -> int:
    from openai import OpenAI

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"[demo] starting kiln serve on {base} (embedded default: builtin:smollm2-135m-instruct)", flush=True)
    proc = subprocess.Popen([sys.executable, "-u", "-m", "kiln.runtime.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port)])
    try:
        t0 = time.monotonic()
        wait_ready(base, proc)
        print(f"[demo] server ready in {time.monotonic() - t0:.1f}s", flush=True)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        question = "What is the capital of France?"
        resp = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": question}],
            temperature=0, max_tokens=48,
        )
        print(f"[demo] Q: {question}")
        print(f"[demo] A: {resp.choices[0].message.content}")
        print(f"[demo] usage: {resp.usage.prompt_tokens} prompt + {resp.usage.completion_tokens} completion tokens")
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
