"""``kiln router`` settings: the typed options and their command line.

    kiln router [--namespace NS ... | --all-namespaces] [--kubeconfig F] [--context C]
                [--backend MODEL=URL[,URL...] ...] [--host 0.0.0.0] [--port 8080]
                [--policy prefix|least-outstanding|round-robin] [--prefix-chars 256]
                [--load-factor 1.25] [--hold-timeout-seconds 300] [--max-held-requests 256]
                [--activity-seconds 10] [--upstream-timeout-seconds 600] [--log-level INFO]

With ``--backend`` the router serves fixed upstreams (no Kubernetes; tests, benchmarks and a
router in front of plain ``kiln serve`` processes); otherwise it discovers every
InferenceEngine of the watched namespaces.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Sequence

POLICIES = ("prefix", "least-outstanding", "round-robin")


@dataclass(frozen=True)
class RouterConfig:
    """Everything ``kiln router`` can be told (flags map 1:1, see ``add_router_args``).

    Fields:
        namespaces: namespaces whose InferenceEngines are routed to; empty: all.
        kubeconfig / context: credentials (default: in-cluster, then ``$KUBECONFIG``).
        backends: fixed upstreams ``{model: (base URL, ...)}``; non-empty turns discovery off.
        host / port: where the router listens.
        policy: replica choice: ``prefix`` (consistent hashing with bounded loads over the
            prompt's first ``prefix_chars`` characters), ``least-outstanding`` or
            ``round-robin``.
        prefix_chars: characters of the rendered prompt hashed by ``prefix``.
        load_factor: the bound of ``prefix``: a replica takes a request only while its
            outstanding requests stay within ``load_factor`` x the mean (> 1).
        hold_timeout_seconds: how long a request waits for a ready replica (an engine scaling
            from zero) before a 503.
        max_held_requests: held requests per model at most; one more gets a 503 at once.
        activity_seconds: how often, at most, the router writes the last-request annotation of
            an engine that scales to zero while requests for it are in flight.
        upstream_timeout_seconds: read timeout of an upstream response (between bytes).
        log_level: logging level name.
    """

    namespaces: tuple[str, ...] = ()
    kubeconfig: str | None = None
    context: str | None = None
    backends: dict[str, tuple[str, ...]] = field(default_factory=dict)
    host: str = "0.0.0.0"
    port: int = 8080
    policy: str = "prefix"
    prefix_chars: int = 256
    load_factor: float = 1.25
    hold_timeout_seconds: float = 300.0
    max_held_requests: int = 256
    activity_seconds: float = 10.0
    upstream_timeout_seconds: float = 600.0
    log_level: str = "INFO"


def _backend(text: str) -> tuple[str, tuple[str, ...]]:
    model, sep, urls = text.partition("=")
    parts = tuple(u.strip().rstrip("/") for u in urls.split(",") if u.strip())
    if not sep or not model or not parts or not all(u.startswith(("http://", "https://")) for u in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not MODEL=URL[,URL...] (URLs start with http:// or https://)")
    return model, parts


def _positive(kind: type):
    def check(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return v
    return check


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < v < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: a port is in [1, 65535]")
    return v


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def _load_factor(text: str) -> float:
    v = _positive(float)(text)
    if v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: the load factor must be above 1 (e.g. 1.25)")
    return v


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``kiln router``."""
    p.add_argument("--namespace", "-n", action="append", default=None,
                   help="route to the InferenceEngines of this namespace (repeatable); default: all namespaces")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="route to every namespace")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--context", default=None, help="kubeconfig context")
    p.add_argument("--backend", action="append", type=_backend, default=None, metavar="MODEL=URL[,URL...]",
                   help="a fixed upstream model and its replicas' base URLs (repeatable; turns discovery off)")
    p.add_argument("--host", default="0.0.0.0", help="listen address")
    p.add_argument("--port", type=_port, default=8080, help="listen port (default: 8080)")
    p.add_argument("--policy", choices=POLICIES, default="prefix",
                   help="replica choice: prefix affinity (consistent hashing with bounded loads), "
                        "least outstanding requests, or round robin")
    p.add_argument("--prefix-chars", type=_positive(int), default=256,
                   help="characters of the rendered prompt that prefix affinity hashes")
    p.add_argument("--load-factor", type=_load_factor, default=1.25,
                   help="prefix affinity's load bound: at most this times the mean outstanding requests per replica")
    p.add_argument("--hold-timeout-seconds", type=_positive(float), default=300.0,
                   help="how long a request waits for a ready replica (scale from zero) before a 503")
    p.add_argument("--max-held-requests", type=_positive(int), default=256,
                   help="held requests per model at most (one more: 503 at once)")
    p.add_argument("--activity-seconds", type=_positive(float), default=10.0,
                   help="how often at most the last-request annotation of a scale-to-zero engine is written")
    p.add_argument("--upstream-timeout-seconds", type=_positive(float), default=600.0,
                   help="read timeout of an upstream response")
    p.add_argument("--log-level", type=_log_level, default=os.environ.get("KILN_LOG_LEVEL", "INFO"),
                   help=f"one of {', '.join(LOG_LEVELS)} (default: KILN_LOG_LEVEL, else INFO)")


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    """The ``RouterConfig`` of parsed flags.  ``KILN_WATCH_NAMESPACES`` (comma-separated) is
    the default namespace list."""
    env_ns = [n for n in os.environ.get("KILN_WATCH_NAMESPACES", "").split(",") if n]
    namespaces = () if a.all_namespaces else tuple(a.namespace or env_ns)
    backends: dict[str, tuple[str, ...]] = {}
    for model, urls in a.backend or []:
        backends[model] = backends.get(model, ()) + urls
    return RouterConfig(
        namespaces=namespaces, kubeconfig=a.kubeconfig, context=a.context, backends=backends,
        host=a.host, port=a.port, policy=a.policy, prefix_chars=a.prefix_chars, load_factor=a.load_factor,
        hold_timeout_seconds=a.hold_timeout_seconds, max_held_requests=a.max_held_requests,
        activity_seconds=a.activity_seconds, upstream_timeout_seconds=a.upstream_timeout_seconds,
        log_level=a.log_level)


def parse_args(argv: Sequence[str]) -> RouterConfig:
    """Parse ``kiln router`` flags (exit 2 with one line on a bad one)."""
    p = argparse.ArgumentParser(prog="kiln router", description="Route OpenAI / KServe v2 requests to InferenceEngines.")
    add_router_args(p)
    return config_from_args(p.parse_args(list(argv)))
