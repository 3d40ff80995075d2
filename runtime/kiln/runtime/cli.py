"""The ``kiln`` command: ``serve``, ``bench``, ``build``, ``eval``, ``adapter``, ``head``, ``engines``, ``router``, ``operator``.

``SUBCOMMANDS`` is a static table: each subcommand's name, help, the function that adds its
flags and the function that runs it, as ``module:function`` strings.  The parser is built for
every subcommand from torch-free modules; a subcommand's heavy modules (torch, kopf...) are
imported only when it runs, so ``kiln operator`` never imports torch.  When a subcommand
cannot import what it needs, ``kiln`` says so in one line naming the missing module and the
extra that installs it, and exits with ``EXIT_MISSING_MODULE`` (a build Job's log shows the
real cause instead of "invalid choice").
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import logging
import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Callable

from kiln.common.constants import HTTP_PORT


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``serve`` and ``bench`` (DESIGN.md's interface)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="builtin:<name>, a .gguf file, a Hugging Face folder or "
                     "hf://org/name[@revision] (default: builtin:smollm2-135m-instruct)")
    src.add_argument("--engine", default=None, help="a Kiln engine folder written by `kiln build`")
    p.add_argument("--download-dir", default=None, help="cache for models from the Hugging Face Hub "
                   "(--model hf://org/name[@revision]; default: $HF_HOME/hub)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences per step (default: 64, at most an engine's build --max-batch-size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: 2048, at most an engine's build --max-num-tokens)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (tokens)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.85,
                   help="fraction of GPU memory for weights + KV cache (CUDA)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides the fraction)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="fp8: an FP8 (E4M3) KV cache, one byte per value (half of bfloat16's); needs an engine built with "
                        "`kiln build --kv-cache-dtype fp8` (calibrated scales) or --load-format dummy. auto: the "
                        "model dtype, or the engine's own")
    p.add_argument("--scheduler-policy", choices=["max_utilization", "guaranteed_no_evict"], default="max_utilization")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable KV block reuse across requests")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights of the model's shape (benchmarks)")
    p.add_argument("--no-verify-checksums", action="store_true",
                   help="with --engine: skip hashing the weight files against the manifest at load (sizes are "
                        "still checked)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N ranks, one process each (NCCL on CUDA: N GPUs; gloo on the CPU)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode eagerly (debugging)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before planning the next (no CPU/GPU overlap; "
                        "asynchronous scheduling is on for CUDA devices only)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads on the CPU (default: KILN_CPU_THREADS, else one per core)")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="structured output: a JSON schema, regex or grammar not compiled this long after its "
                        "request arrived is refused with a 400")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=["ngram", "draft", "eagle"], default=None,
                      help="propose draft tokens that the model verifies in one step: ngram (prompt lookup), draft "
                           "(a smaller model with the same tokenizer, e.g. an int4 engine of this one), eagle (an "
                           "EAGLE / EAGLE-3 head checkpoint); default: off")
    spec.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                      help="drafts per sequence and step (default: 4)")
    spec.add_argument("--speculative-model", default=None, metavar="SRC",
                      help="draft: a model source (as --model) or a `kiln build` engine folder; eagle: the head")
    spec.add_argument("--prompt-lookup-min", type=int, default=None, metavar="N",
                      help="ngram: shortest suffix matched (tokens; default: 2)")
    spec.add_argument("--prompt-lookup-max", type=int, default=None, metavar="N",
                      help="ngram: longest suffix matched (tokens; default: 5)")
    spec.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="SEQS",
                      help="draft at every step with up to this many sequences, none above (default: up to 8 "
                           "sequences, where drafts are measured to pay; see README, Speculative decoding)")
    kern = p.add_argument_group("kernels (CUDA)")
    kern.add_argument("--no-pdl", action="store_true",
                      help="launch kernels without programmatic dependent launch (A/B runs, profiles)")
    kern.add_argument("--no-fused-rope-kv", action="store_true",
                      help="rotary embedding and KV-cache write as two kernels instead of one")
    kern.add_argument("--w4a16-dequant-min-m", type=int, default=65, metavar="TOKENS",
                      help="from this many tokens in a step, int4 GEMMs dequantize the weight and use cuBLAS")


def engine_args_from(ns: argparse.Namespace):
    """``EngineArgs`` from the flags of ``add_engine_args`` (ValueError for invalid values)."""
    from .config import EngineArgs  # noqa: PLC0415

    from .config import env_hub_options  # noqa: PLC0415

    threads = {} if ns.cpu_threads is None else {"cpu_threads": ns.cpu_threads}  # else KILN_CPU_THREADS
    return EngineArgs(hub=env_hub_options(getattr(ns, "download_dir", None)),
        model=ns.model, engine=ns.engine, verify_checksums=not ns.no_verify_checksums, device=ns.device,
        dtype=ns.dtype,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len, block_size=ns.block_size,
        kv_cache_memory_fraction=ns.kv_cache_memory_fraction, num_kv_blocks=ns.num_kv_blocks,
        kv_cache_dtype=ns.kv_cache_dtype,
        scheduler_policy=ns.scheduler_policy, enable_prefix_caching=not ns.no_prefix_caching,
        load_format=ns.load_format, seed=ns.seed, served_model_name=getattr(ns, "served_model_name", None),
        enable_cuda_graphs=not ns.no_cuda_graphs, async_scheduling=False if ns.no_async_scheduling else None,
        pdl=not ns.no_pdl, fused_rope_kv=not ns.no_fused_rope_kv, w4a16_dequant_min_m=ns.w4a16_dequant_min_m,
        quantization=getattr(ns, "quantization", None) or "none", tensor_parallel_size=ns.tensor_parallel_size,
        grammar_compile_timeout=ns.grammar_compile_timeout,
        speculative_method=ns.speculative_method, num_speculative_tokens=ns.num_speculative_tokens,
        speculative_model=ns.speculative_model, prompt_lookup_min=ns.prompt_lookup_min,
        prompt_lookup_max=ns.prompt_lookup_max,
        speculative_disable_by_batch_size=ns.speculative_disable_by_batch_size,
        **threads, **lora_args_from(ns),
    )


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """``--lora-modules name=FOLDER ...`` as ``{name: folder}`` (ValueError for a spec
    without ``=``, an empty part or a repeated name)."""
    out: dict[str, str] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=FOLDER (a PEFT adapter folder)")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out[name] = path
    return out


def lora_args_from(ns: argparse.Namespace) -> dict:
    """The LoRA fields of ``EngineArgs`` from ``kiln serve``'s flags (none for other commands)."""
    if not hasattr(ns, "max_loras"):
        return {}
    return dict(enable_lora=ns.enable_lora, lora_modules=parse_lora_modules(ns.lora_modules),
                max_loras=ns.max_loras, max_lora_rank=ns.max_lora_rank, max_cpu_loras=ns.max_cpu_loras,
                lora_dir=ns.lora_dir, lora_modules_file=ns.lora_modules_file)


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
    """Run ``kiln serve``: check the flags and the port, start the engine core process, then
    the API server process(es); serve until SIGTERM."""
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
    api_key = ns.api_key if ns.api_key is not None else os.environ.get("KILN_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key (or KILN_API_KEY) is empty: give a key, or leave it out to serve without one")
    for flag, value, low in (("--api-server-count", ns.api_server_count, 1),
                             ("--max-request-sequences", ns.max_request_sequences, 1),
                             ("--max-chat-messages", ns.max_chat_messages, 1),
                             ("--max-request-body-bytes", ns.max_request_body_bytes, 1024)):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    for flag, value in (("--request-body-timeout", ns.request_body_timeout), ("--header-timeout", ns.header_timeout)):
        if not 0 < value <= 3600:
            raise ValueError(f"{flag} must be in (0, 3600] seconds, got {value}")
    if ns.protect_metrics and not api_key:
        raise ValueError("--protect-metrics needs an API key (--api-key or KILN_API_KEY)")
    check_can_listen(ns.host, ns.port)
    from .compile_cache import ensure_writable_cache_dir  # noqa: PLC0415

    ensure_writable_cache_dir(os.environ)  # before the first Triton compile (the warm-up)

    from .engine_core.client import CoreStartError  # noqa: PLC0415
    from .server.launcher import ServeOptions, serve  # noqa: PLC0415
    from .server.serving import ServerLimits  # noqa: PLC0415

    opts = ServeOptions(
        host=ns.host, port=ns.port, api_key=api_key, api_server_count=ns.api_server_count,
        limits=ServerLimits(ns.max_request_sequences, ns.max_chat_messages, ns.max_request_body_bytes,
                            ns.request_body_timeout),
        protect_metrics=ns.protect_metrics, shutdown_timeout=ns.shutdown_timeout, header_timeout=ns.header_timeout,
        log_level=ns.log_level, tool_call_parser=ns.tool_call_parser)
    try:
        return serve(engine_args_from(ns), opts)
    except CoreStartError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return e.exit_code


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``kiln serve``'s flags: the engine's (``add_engine_args``) and the HTTP server's."""
    add_engine_args(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=HTTP_PORT)
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the source)")
    p.add_argument("--api-key", default=None, help="require this bearer token on /v1/* and the v2 generate "
                   "endpoints (env KILN_API_KEY); an empty key is an error")
    p.add_argument("--protect-metrics", action="store_true",
                   help="also require the API key on /metrics and the API docs pages (/docs, /openapi.json)")
    p.add_argument("--quantization", choices=["none", "fp8", "int8-smoothquant", "int4-awq", "int4-gptq"],
                   default="none", help="with --load-format dummy: quantize the random weights at load (round to "
                   "nearest; benchmarks). A real model is quantized by `kiln build`; an engine carries its own")
    lora = p.add_argument_group("LoRA adapters (PEFT folders; a request selects one by its model name)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (implied by --lora-modules); load more with POST /v1/load_lora_adapter")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=FOLDER",
                      help="adapters loaded at start, each served under NAME")
    lora.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one step (device slots)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served (1..64)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept in host memory (default: --max-loras); others are re-read from disk")
    lora.add_argument("--lora-dir", default=None, metavar="DIR",
                      help="adapter folders are taken relative to DIR and may not leave it (--lora-modules, "
                           "POST /v1/load_lora_adapter's lora_path); default: any path")
    lora.add_argument("--lora-modules-file", default=None, metavar="FILE",
                      help='a JSON object {"NAME": "FOLDER", ...} of adapters loaded at start (implies '
                           "--enable-lora); one that cannot be served is skipped with a warning (the operator's "
                           "list: it reports the failure)")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="API server processes on the port (HTTP, tokenization, detokenization), all in front "
                        "of one engine core process (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=45.0,
                   help="seconds that running requests get to finish after SIGTERM (default: %(default)s; the "
                        "operator's pods have a 60 s grace period)")
    p.add_argument("--max-request-sequences", type=int, default=256,
                   help="prompts x n of one request at most (default: %(default)s)")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json", "mistral"), default="hermes",
                   help="the served model's tool-call format: parsed from outputs with tools, forced by a grammar "
                   "for tool_choice required / a named function (default: %(default)s)")
    p.add_argument("--max-chat-messages", type=int, default=1024,
                   help="messages of one chat request at most (default: %(default)s)")
    p.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                   help="request body size at most; larger bodies get 413 (default: %(default)s)")
    p.add_argument("--request-body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive; slower ones get 408 (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a new connection may take to send its request headers (default: %(default)s)")


def add_operator_args(p: argparse.ArgumentParser) -> None:
    """``kiln operator``: every argument goes to the operator's own parser."""
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the operator")


def cmd_operator(ns: argparse.Namespace) -> int:
    """Run the kopf operator with the arguments after ``operator``."""
    from kiln.operator.main import run  # noqa: PLC0415

    return int(run(ns.args) or 0)


@dataclass(frozen=True)
class Subcommand:
    """One ``kiln`` subcommand.

    Fields:
        name: the word after ``kiln``.
        help: its line in ``kiln --help``.
        args: ``module:function`` that adds its flags to its parser; a torch-free module.
        run: ``module:function`` that runs it: ``(argparse.Namespace) -> exit code``.
        extra: the pip extra that installs what ``run`` imports (``kiln[<extra>]``).
        own_help: it parses its own arguments, ``--help`` included (``kiln operator``).
    """

    name: str
    help: str
    args: str
    run: str
    extra: str
    own_help: bool = False


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("serve", "serve a model over an OpenAI-compatible HTTP API",
               "kiln.runtime.cli:add_serve_args", "kiln.runtime.cli:cmd_serve", "runtime"),
    Subcommand("bench", "benchmark throughput and latency",
               "kiln.runtime.bench:add_bench_args", "kiln.runtime.bench:run_bench", "runtime"),
    Subcommand("build", "quantize and compile a model into an engine",
               "kiln.runtime.build_cli:add_build_args", "kiln.runtime.build_cli:run_build", "runtime"),
    Subcommand("eval", "accuracy of a model or engine (perplexity, greedy agreement)",
               "kiln.runtime.eval:add_eval_args", "kiln.runtime.eval:run_eval", "runtime"),
    Subcommand("adapter", "fetch a LoRA adapter into a folder, checked against an engine",
               "kiln.runtime.adapter_cli:add_adapter_args", "kiln.runtime.adapter_cli:run_adapter", "runtime"),
    Subcommand("head", "fetch an EAGLE / EAGLE-3 head checkpoint into a folder, checked",
               "kiln.runtime.head_cli:add_head_args", "kiln.runtime.head_cli:run_head", "runtime"),
    Subcommand("engines", "list the engine cache and clean it up (kiln engines list | gc)",
               "kiln.operator.engines_cli:add_engines_args", "kiln.operator.engines_cli:run_engines", "operator"),
    Subcommand("router", "route OpenAI / KServe v2 requests to InferenceEngines (holds them while one scales from zero)",
               "kiln.operator.router.config:add_router_args", "kiln.operator.router.app:run_router", "router"),
    Subcommand("operator", "run the Kubernetes operator (kopf)",
               "kiln.runtime.cli:add_operator_args", "kiln.runtime.cli:cmd_operator", "operator", own_help=True),
)

EXIT_MISSING_MODULE = 1  # a subcommand could not import a module it needs
EXIT_USER_ERROR = 2  # a bad flag, model, engine or setting: one line on stderr
EXIT_INTERRUPTED = 130  # Ctrl-C


def _load(ref: str) -> Callable:
    """The function named by ``module:function`` (imports the module)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _run(cmd: Subcommand, ns: argparse.Namespace) -> int:
    """Import ``cmd``'s run function and call it."""
    return int(_load(cmd.run)(ns) or 0)


def _raise(error: ImportError, ns: argparse.Namespace) -> int:
    """Stands in for a subcommand whose flags module did not import: running it re-raises."""
    raise error


def _add_subcommand(sub, cmd: Subcommand) -> None:
    """Add ``cmd``'s parser to ``sub``.  A flags module that cannot be imported still leaves
    the subcommand in ``kiln --help``; running it, with any arguments, reports the import error."""
    try:
        add_args = _load(cmd.args)
    except ImportError as e:
        p = sub.add_parser(cmd.name, help=cmd.help, add_help=False)
        p.set_defaults(func=functools.partial(_raise, e), flags_unknown=True)
        return
    p = sub.add_parser(cmd.name, help=cmd.help, **({"add_help": False} if cmd.own_help else {}))
    add_args(p)
    p.set_defaults(func=functools.partial(_run, cmd))


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line and exit 2, without the usage block
    (``--help`` prints it); its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``kiln`` parser with every subcommand of ``SUBCOMMANDS``."""
    parser = OneLineErrorParser(prog="kiln", description="Kiln: LLM inference runtime and Kubernetes operator")
    parser.add_argument("--log-level", default=os.environ.get("KILN_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in SUBCOMMANDS:
        _add_subcommand(sub, cmd)
    return parser


def _call(name: str, fn: Callable[[], int]) -> int:
    """Run subcommand ``name``'s ``fn``; a missing module or a user error is one line on stderr."""
    try:
        return fn()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ImportError as e:
        extra = next(c.extra for c in SUBCOMMANDS if c.name == name)
        missing = e.name or str(e)
        print(f"kiln {name}: error: cannot import module {missing!r} ({e}); `kiln {name}` needs "
              f"pip install 'kiln[{extra}]'", file=sys.stderr)
        return EXIT_MISSING_MODULE
    except (ValueError, FileNotFoundError, PermissionError) as e:  # user mistakes: bad model, flag, path
        print(f"kiln: error: {_as_flags(str(e))}", file=sys.stderr)
        return EXIT_USER_ERROR


def _as_flags(message: str) -> str:
    """``message`` with the ``EngineArgs`` field names of several words (``max_num_seqs``)
    spelled as the flags that set them (``--max-num-seqs``): the engine's checks name fields,
    a command line user knows flags."""
    import dataclasses  # noqa: PLC0415

    try:
        from .config import EngineArgs  # noqa: PLC0415
    except ImportError:  # an image without the runtime's dependencies (the operator's)
        return message
    names = sorted((f.name for f in dataclasses.fields(EngineArgs) if "_" in f.name), key=len, reverse=True)
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, names)) + r")(?![\w/])")
    return pattern.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


def main(argv: list[str] | None = None) -> int:
    """Run ``kiln`` with ``argv`` (default: the process's arguments); returns the exit code."""
    raw = list(sys.argv[1:] if argv is None else argv)
    if "operator" in raw:  # everything after `operator` belongs to the operator's own parser
        i = raw.index("operator")
        if all(a.startswith("--log-level") or raw[j - 1] == "--log-level" for j, a in enumerate(raw[:i])):
            ns = argparse.Namespace(args=raw[i + 1:])
            return _call("operator", lambda: cmd_operator(ns))
    parser = build_parser()
    ns, unknown = parser.parse_known_args(raw)
    if unknown and not getattr(ns, "flags_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.log_level.upper() != "DEBUG":  # a line per HTTP request of the Hub client is debugging output
        for noisy in ("httpx", "httpcore", "huggingface_hub"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    return _call(ns.command, lambda: ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
