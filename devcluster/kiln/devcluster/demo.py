"""The README's first command on Kubernetes: `kubectl apply` an InferenceEngine and ask it
"What is the capital of France?" through its Service with the `openai` client.

    .venv/bin/python -m kiln.devcluster.demo [--example examples/smollm2.yaml] [--down]   # make demo

Without KUBECONFIG (or with KUBECONFIG pointing at a test plane) it builds or reuses the test
control plane's binaries, starts plane "demo" with one process-backed node (pods run as local
processes), `helm install`s helm/kiln with its default values (the chart's operator pod runs on
that node with its ServiceAccount's projected token, as in any cluster), applies the example, prints progress until Ready, asks the question through
a local proxy to the Service's ready endpoints, and leaves everything running for you to play
with (`--down` tears it down at the end instead).  A second run reuses the running plane and
the built engine.

With KUBECONFIG pointing at a real cluster it `helm install`s the chart there (the operator
runs in the cluster), applies the example, waits for Ready and asks through
`kubectl port-forward svc/<name> :8000`.

Waits give up only when nothing advances for --stall seconds (phase, build state and progress, pods, the
pods' logs), never on a fixed deadline: a loaded machine makes the demo slower, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from kiln.devcluster import procs
from kiln.devcluster.paths import REPO
from kiln.devcluster.plane import PLANES_HOME, bin_dir
from kiln.devcluster.stack import Stack
from kiln.devcluster.wait import wait_for

QUESTION = "What is the capital of France?"


def say(msg: str) -> None:
    print(f"[kiln-demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ask(base_url: str, question: str = QUESTION) -> str:
    from openai import OpenAI
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=3, timeout=120)
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                          temperature=0, max_tokens=48)
    return resp.choices[0].message.content


def example_name(path: Path) -> str:
    m = re.search(r"^metadata:\s*\n\s+name:\s*(\S+)", path.read_text(), re.M)
    if not m:
        raise ValueError(f"no metadata.name in {path}")
    return m.group(1)


def is_test_plane(kubeconfig: str | None) -> bool:
    return not kubeconfig or Path(kubeconfig).resolve().is_relative_to(Path(PLANES_HOME).resolve())


def on_plane(a: argparse.Namespace) -> int:
    name = example_name(a.example)
    stack = Stack(a.plane, detached=True)
    t_start = time.monotonic()
    ok = False
    try:
        stack.up()
        stack.ensure_namespace(a.namespace)
        shown = a.example.relative_to(REPO) if a.example.is_relative_to(REPO) else a.example
        say(f"kubectl apply -n {a.namespace} -f {shown}")
        t0 = time.monotonic()
        stack.apply_file(a.example, a.namespace)
        waited = stack.wait_ready(name, a.namespace, stall=a.stall)
        st = stack.engine(name, a.namespace)["status"]
        say(f"{name} is Ready {waited:.1f} s after apply (engine {st.get('engineHash', '')[:12]}, "
            f"build {(st.get('build') or {}).get('state')}, endpoint {st.get('endpoint')})")
        proxy = stack.proxy(name, a.namespace)
        eps = proxy.wait_endpoints(1, progress=lambda: stack.progress(a.namespace))
        say(f"Service {a.namespace}/{name}: ready endpoints {eps}; local proxy {proxy.url}")
        answer = ask(proxy.url)
        say(f"Q: {QUESTION}")
        say(f"A: {answer}")
        say(f"apply -> answer {time.monotonic() - t0:.1f} s, whole demo {time.monotonic() - t_start:.1f} s")
        ok = "paris" in answer.lower()
        if not a.down:
            print(f"""
Still running: plane {a.plane!r}, node proc-0 (pods are local processes), the operator pod in kiln-system.
    export KUBECONFIG={stack.plane.kubeconfig}
    {stack.plane.kubectl_bin} get ie,pods,jobs,svc -n {a.namespace}
    {stack.plane.kubectl_bin} logs -n kiln-system deploy/kiln -c operator   # the operator's log
    .venv/bin/python -m kiln.devcluster.procnode logs {a.namespace} <pod> --plane {a.plane}   # pod logs
Tear down (stops the plane, the node's processes and the operator, removes the node's volumes):
    make demo-down   # or: .venv/bin/python -m kiln.devcluster.demo --down-only --plane {a.plane}
""", flush=True)
        return 0 if ok else 2
    except BaseException:
        say(f"failed; logs under {stack.plane.dir} (procnode.log, procnode/proc-0/pods/: the operator's is "
            f"{stack.operator_log()})")
        raise
    finally:
        for p in stack.proxies:
            p.stop()
        if a.down:
            stack.down()
            say(f"torn down (plane {a.plane!r} stopped)")


def on_real_cluster(a: argparse.Namespace) -> int:
    cached = None
    try:
        cached = bin_dir(build=False)  # the test plane's kubectl and helm, when built
    except (FileNotFoundError, OSError):
        pass
    kubectl = shutil.which("kubectl") or (str(cached / "kubectl") if cached else "kubectl")
    helm = shutil.which("helm") or (str(cached / "helm") if cached else "helm")
    name = example_name(a.example)
    say(f"KUBECONFIG={os.environ['KUBECONFIG']}: using that cluster")
    subprocess.run([helm, "upgrade", "--install", "kiln", str(REPO / "helm/kiln"), "-n", "kiln-system",
                    "--create-namespace", "--wait"], check=True)
    subprocess.run([kubectl, "create", "namespace", a.namespace], check=False, capture_output=True)
    subprocess.run([kubectl, "apply", "-n", a.namespace, "-f", str(a.example)], check=True)
    t0 = time.monotonic()
    last: list = [None]

    def ready() -> bool:
        out = subprocess.run([kubectl, "get", "ie", name, "-n", a.namespace, "-o", "json"],
                             capture_output=True, text=True).stdout
        st = json.loads(out or "{}").get("status") or {}
        build = st.get("build") or {}
        view = (st.get("phase"), build.get("state"), st.get("readyReplicas"), build.get("progress"))
        if view != last[0]:  # each step of the build's progress counts as progress of the wait
            where = f" ({view[3]})" if view[3] else ""
            say(f"  +{time.monotonic() - t0:5.1f}s  phase={view[0]} build={view[1]}{where} ready={view[2]}")
            last[0] = view
        return st.get("phase") == "Ready"

    wait_for(f"{name} Ready", ready, stall=a.stall, interval=2, progress=lambda: last[0], check_every=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pf = subprocess.Popen([kubectl, "port-forward", "-n", a.namespace, f"svc/{name}", f"{port}:8000"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)
        answer = ask(f"http://127.0.0.1:{port}")
        say(f"Q: {QUESTION}")
        say(f"A: {answer}")
    finally:
        pf.terminate()
    say(f"tear down: kubectl delete -n {a.namespace} -f {a.example}; helm uninstall kiln -n kiln-system")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the Kiln demo on Kubernetes (the test plane, or $KUBECONFIG's cluster)")
    p.add_argument("--example", type=Path, default=REPO / "examples" / "smollm2.yaml")
    p.add_argument("--namespace", default="default")
    p.add_argument("--plane", default=os.environ.get("KILN_DEMO_PLANE", "demo"))
    p.add_argument("--stall", type=float, default=600,
                   help="give up when nothing has advanced for this many seconds (default 600)")
    p.add_argument("--down", action="store_true", help="tear everything down after the answer")
    p.add_argument("--down-only", action="store_true", help="only tear down a plane left running")
    a = p.parse_args(argv)
    a.example = a.example.resolve()
    procs.interrupt_on_signals()  # SIGTERM/SIGHUP end the demo like Ctrl-C (its `finally` runs)
    if a.down_only:
        Stack(a.plane).down()
        say(f"plane {a.plane!r}, its node's processes and the operator stopped")
        return 0
    if is_test_plane(os.environ.get("KUBECONFIG")):
        return on_plane(a)
    return on_real_cluster(a)


if __name__ == "__main__":
    sys.exit(main())
