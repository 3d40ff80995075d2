"""The ``kiln`` command: ``serve``, ``build``, ``eval``, ``bench``, ``operator``.

Heavy modules are imported inside each subcommand so ``kiln operator`` never imports torch.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``serve`` and ``bench`` (DESIGN.md's interface)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="builtin:<name>, a .gguf file or a Hugging Face folder "
                     "(default: builtin:smollm2-135m-instruct)")
    src.add_argument("--engine", default=None, help="a Kiln engine folder written by `kiln build`")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences per step (default: 64, at most an engine's build --max-batch-size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: 2048, at most an engine's build --max-num-tokens)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (tokens)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.85,
                   help="fraction of GPU memory for weights + KV cache (CUDA)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides the fraction)")
    p.add_argument("--scheduler-policy", choices=["max_utilization", "guaranteed_no_evict"], default="max_utilization")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable KV block reuse across requests")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights of the model's shape (benchmarks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode eagerly (debugging)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before planning the next (no CPU/GPU overlap; "
                        "asynchronous scheduling is on for CUDA devices only)")


def engine_args_from(ns: argparse.Namespace):
    from .config import EngineArgs  # noqa: PLC0415

    return EngineArgs(
        model=ns.model, engine=ns.engine, device=ns.device, dtype=ns.dtype,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len, block_size=ns.block_size,
        kv_cache_memory_fraction=ns.kv_cache_memory_fraction, num_kv_blocks=ns.num_kv_blocks,
        scheduler_policy=ns.scheduler_policy, enable_prefix_caching=not ns.no_prefix_caching,
        load_format=ns.load_format, seed=ns.seed, served_model_name=getattr(ns, "served_model_name", None),
        enable_cuda_graphs=not ns.no_cuda_graphs, async_scheduling=False if ns.no_async_scheduling else None,
    )


def check_can_listen(host: str, port: int) -> None:
    """Raise ValueError when ``host:port`` cannot be bound (port in use, unknown address), so
    ``kiln serve`` fails before loading the model.  The test socket is bound as uvicorn binds
    (SO_REUSEADDR) and closed at once; a port taken after this check still fails in uvicorn."""
    if port == 0:  # any free port
        return
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use; stop what holds it or pick another --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_serve(ns: argparse.Namespace) -> int:
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {ns.port}")
    if ns.served_model_name is not None and not ns.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty (leave it out to serve under the source's name)")
    if ns.served_model_name is not None and (ns.served_model_name != ns.served_model_name.strip()
                                             or not ns.served_model_name.isprintable()):
        raise ValueError(f"--served-model-name {ns.served_model_name!r}: no leading or trailing spaces and no "
                         "control characters (clients must send the name exactly)")
    if not 0 <= ns.shutdown_timeout <= 3600:
        raise ValueError(f"--shutdown-timeout must be between 0 and 3600 seconds, got {ns.shutdown_timeout}")
    check_can_listen(ns.host, ns.port)
    from .compile_cache import ensure_writable_cache_dir  # noqa: PLC0415

    ensure_writable_cache_dir()  # before the first Triton compile (the warm-up)

    import uvicorn  # noqa: PLC0415

    from .engine import LLMEngine  # noqa: PLC0415
    from .server.api import build_app  # noqa: PLC0415

    api_key = ns.api_key or os.environ.get("KILN_API_KEY") or None
    engine = LLMEngine(engine_args_from(ns))
    app = build_app(engine, api_key=api_key)
    # on SIGTERM: stop accepting, let running requests finish for up to --shutdown-timeout seconds
    # (the operator's pods have 60 s of grace), then cancel the rest
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                timeout_graceful_shutdown=ns.shutdown_timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: LLM inference runtime and Kubernetes operator")
    parser.add_argument("--log-level", default=os.environ.get("KILN_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(sp)
    sp.add_argument("--host", default="0.0.0.0")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--served-model-name", default=None, help="model name clients use (default: the source)")
    sp.add_argument("--api-key", default=None, help="require this bearer token on /v1/* (env KILN_API_KEY)")
    sp.add_argument("--shutdown-timeout", type=float, default=45.0,
                    help="seconds that running requests get to finish after SIGTERM (default: %(default)s; the "
                         "operator's pods have a 60 s grace period)")
    sp.set_defaults(func=cmd_serve)

    bp = sub.add_parser("bench", help="benchmark throughput and latency")
    try:
        from .bench import add_bench_args  # noqa: PLC0415

        add_bench_args(bp)
    except ImportError:  # pragma: no cover
        pass

    try:
        from . import build as _build  # noqa: PLC0415

        bld = sub.add_parser("build", help="quantize and compile a model into an engine")
        _build.add_build_args(bld)
        bld.set_defaults(func=_build.run_build)
    except ImportError:
        pass
    try:
        from . import eval as _eval  # noqa: PLC0415

        _eval.add_eval_args(sub)
    except ImportError:
        pass

    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf)", add_help=False)
    op.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the operator")
    op.set_defaults(func=lambda ns: _run_operator(ns.args))

    raw = list(sys.argv[1:] if argv is None else argv)
    if "operator" in raw:  # everything after `operator` belongs to the operator's own parser
        i = raw.index("operator")
        if all(a.startswith("--log-level") or raw[j - 1] == "--log-level" for j, a in enumerate(raw[:i])):
            return _run_operator(raw[i + 1 :])
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # clear one-line errors for user mistakes
        from .loader import ModelSourceError  # noqa: PLC0415
        from .model.config import UnsupportedModelError  # noqa: PLC0415

        if isinstance(e, (ModelSourceError, UnsupportedModelError, ValueError, FileNotFoundError, PermissionError)):
            print(f"kiln: error: {e}", file=sys.stderr)
            return 2
        raise


def _run_operator(args: list[str]) -> int:
    from kiln.operator.main import run  # noqa: PLC0415

    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
