"""``kiln bench serve``: what users of a live server see, measured from its SSE stream.

Each request is a streamed ``/v1/completions`` call with token-id prompts (EOS ignored); times
are taken when each chunk arrives, so:

* TTFT (time to first token): request sent -> first chunk carrying text;
* ITL (inter-token latency): the gaps between successive text chunks;
* TPOT (time per output token): ``(e2e - TTFT) / (output tokens - 1)``, per request;
* e2e latency: request sent -> stream closed.

A stream that delivers all of a request's tokens in at most one chunk (``max_tokens`` > 1)
measures nothing of the above: it is counted (``bulk_streams``) and warned about.

Load follows vLLM's ``benchmark_serving``: requests arrive at ``--request-rate`` per second
(Poisson, or a gamma process of shape ``--burstiness``: below 1 burstier, above 1 more
regular; infinite rate: all at once), at most ``--max-concurrency`` in flight.  Comma lists of
rates or concurrencies run one benchmark each, printed as one table.  Goodput (DistServe, Zhong
et al., OSDI 2024) is the rate of requests meeting every SLO of ``--goodput`` (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field

from .bench_common import (Workload, add_workload_args, check_workload_flags, check_writable, describe_workload,
                           json_safe, pct, positive_int, workload_from_flags)

SLO_KEYS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "e2e latency"}
DEFAULT_CONCURRENCY = 16  # in flight at most when neither a rate nor a concurrency is given
DEFAULT_URL_VOCAB_SIZE = 49152  # prompt ids below this with --url (the embedded default's vocabulary)


class BenchError(RuntimeError):
    """The benchmark cannot run: the server at ``--url`` cannot be reached or is not an
    OpenAI-style server (exit status 2, as for a bad flag)."""


@dataclass
class RequestResult:
    """One streamed request; times in seconds from when it was sent.

    Fields:
        max_tokens: tokens asked for.
        error: why it failed (None: it succeeded).
        ttft: to the first chunk with text (e2e when none came).
        e2e: to the end of the stream.
        output_tokens: the server's ``usage.completion_tokens`` (else the text chunks).
        chunk_times: arrival of each chunk with text.
    """

    max_tokens: int
    error: str | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None below 2 tokens)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itl(self) -> list[float]:
        """Seconds between successive text chunks."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def bulk(self) -> bool:
        """All of several tokens arrived in at most one chunk: nothing streamed."""
        return self.max_tokens > 1 and self.output_tokens > 1 and len(self.chunk_times) <= 1


def error_reason(status: int, body: bytes) -> str:
    """``"<status>: <message>"`` from an OpenAI-style error body ``{"error": {"message": ...}}``
    (else the start of the raw body)."""
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode("utf-8", "replace").strip()[:300]
    return f"{status}: {msg}" if msg else str(status)


def served_model(url: str) -> str:
    """The first model the server at ``url`` lists at /v1/models.  Raises BenchError."""
    import httpx  # noqa: PLC0415

    try:
        r = httpx.get(f"{url}/v1/models", timeout=30)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach the server at {url}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"the server at {url} answered GET /v1/models with {error_reason(r.status_code, r.content)}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"the server at {url} does not list a model at /v1/models (not an OpenAI-style server?)") \
            from None


async def stream_one(session, url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    """Send one streamed completion to ``url`` (an ``aiohttp.ClientSession``: its C HTTP
    parser reads a chunk for about a third of httpx's client CPU, so one client process keeps
    up with thousands of tokens per second) and time its chunks."""
    import aiohttp  # noqa: PLC0415

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(max_tokens)
    usage = None
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                res.error = error_reason(r.status, await r.read())
                return res
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    res.error = error_reason(r.status, line[6:].strip())
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"].get("completion_tokens")
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    res.chunk_times.append(now)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        # where it broke: before the response, or mid-stream after some chunks
        res.error = (f"{type(e).__name__}: {e or 'connection closed or reset'} (after {len(res.chunk_times)} "
                     f"chunks, {time.perf_counter() - t0:.2f} s)")
        return res
    res.e2e = time.perf_counter() - t0
    res.ttft = res.chunk_times[0] if res.chunk_times else res.e2e
    res.output_tokens = usage if usage is not None else len(res.chunk_times)
    return res


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between successive request arrivals: gamma-distributed with shape
    ``burstiness`` and mean ``1 / rate`` (burstiness 1: a Poisson process); zeros for an
    infinite rate (all requests at once)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


# The benchmark client's own CPU seconds (user + system) during the last run_load: a client
# near one CPU per wall second is itself the limit of what it measures.
CLIENT_CPU = {"seconds": float("nan")}


async def run_load(url: str, model: str, wl: Workload, rate: float, concurrency: int | None, burstiness: float,
                   seed: int) -> tuple[list[RequestResult], float]:
    """Send the workload at ``rate`` requests/s (at most ``concurrency`` in flight, None: no
    limit); returns the results in workload order and the wall time (seconds)."""
    import aiohttp  # noqa: PLC0415

    sem = asyncio.Semaphore(concurrency) if concurrency else None
    connector = aiohttp.TCPConnector(limit=(concurrency or len(wl.prompts)) + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as client:
        async def one(prompt: list[int], max_tokens: int) -> RequestResult:
            if sem is None:
                return await stream_one(client, f"{url}/v1/completions", model, prompt, max_tokens)
            async with sem:
                return await stream_one(client, f"{url}/v1/completions", model, prompt, max_tokens)

        tasks = []
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for gap, prompt, max_tokens in zip(arrival_gaps(len(wl.prompts), rate, burstiness, seed), wl.prompts,
                                           wl.output_lens):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        CLIENT_CPU["seconds"] = time.process_time() - cpu0
        return list(results), wall


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (seconds; ITL: each gap)."""
    values = {"ttft": [r.ttft], "tpot": [r.tpot or 0.0], "itl": r.itl, "e2el": [r.e2e]}
    return all(v <= limit for key, limit in slos.items() for v in values[key])


def summarize(results: list[RequestResult], wall: float, rate: float, concurrency: int | None,
              slos: dict[str, float]) -> dict:
    """One run's row: throughput, TTFT / TPOT / ITL / e2e percentiles (seconds), errors,
    streams delivered at once, and goodput (requests/s meeting every SLO) when SLOs are set."""
    ok = [r for r in results if r.error is None]
    ttft, e2e = [r.ttft for r in ok], [r.e2e for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [g for r in ok for g in r.itl]
    toks = sum(r.output_tokens for r in ok)
    row = {"engine": "kiln serve", "concurrency": concurrency, "request_rate": None if math.isinf(rate) else rate,
           "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall, "output_tokens": toks,
           "output_tok_s": toks / wall, "requests_s": len(ok) / wall,
           "chunks_per_request_mean": sum(len(r.chunk_times) for r in ok) / len(ok) if ok else float("nan"),
           "bulk_streams": sum(r.bulk for r in ok)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        row[f"{name}_mean_s"] = sum(xs) / len(xs) if xs else float("nan")
        for p in (50, 90, 99):
            row[f"{name}_p{p}_s"] = pct(xs, p)
    if slos:
        row["goodput_requests_s"] = sum(meets(r, slos) for r in ok) / wall
        row["slo_s"] = dict(slos)
    row["first_error"] = next((r.error for r in results if r.error), None)
    return row


def print_table(rows: list[dict], file=None) -> None:
    """The runs as one table (milliseconds for latencies)."""
    goodput = any("goodput_requests_s" in r for r in rows)
    head = (f"{'conc':>5s} {'rate':>7s} {'req/s':>7s} {'out tok/s':>10s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
            f"{'TPOT p50':>9s} {'TPOT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'E2E p50':>9s} {'E2E p99':>9s}"
            + (f" {'goodput':>8s}" if goodput else "") + f" {'errors':>6s}")
    print(head, file=file)

    def ms(v, w=9):
        return f"{v * 1e3:{w}.1f}" if v is not None and v == v else f"{'-':>{w}s}"

    for r in rows:
        conc = "-" if r["concurrency"] is None else str(r["concurrency"])
        rate = "inf" if r["request_rate"] is None else f"{r['request_rate']:g}"
        line = (f"{conc:>5s} {rate:>7s} {r['requests_s']:7.2f} {r['output_tok_s']:10.1f} {ms(r['ttft_p50_s'])} "
                f"{ms(r['ttft_p99_s'])} {ms(r['tpot_p50_s'])} {ms(r['tpot_p99_s'])} {ms(r['itl_p50_s'], 8)} "
                f"{ms(r['itl_p99_s'], 8)} {ms(r['e2e_p50_s'])} {ms(r['e2e_p99_s'])}")
        if goodput:
            line += f" {r.get('goodput_requests_s', float('nan')):8.2f}"
        print(line + f" {r['errors']:6d}", file=file)


# -- flags ---------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    """argparse type: ``8`` or ``1,8,64,256`` (each >= 1)."""
    try:
        return [positive_int(t) for t in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _rate_list(text: str) -> list[float]:
    """argparse type: requests per second, ``4`` or ``1,2,inf`` (each > 0; ``inf``: all at once)."""
    out = []
    for t in text.split(","):
        try:
            v = float(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{t!r} is not a number (or inf)") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be above 0 (or inf), got {t}")
        out.append(v)
    return out


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return v


def _slo(text: str) -> tuple[str, float]:
    """argparse type: ``metric:milliseconds`` -> ``(metric, seconds)``."""
    key, sep, value = text.partition(":")
    if not sep or key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected METRIC:MS with METRIC one of {', '.join(SLO_KEYS)}")
    try:
        return key, _positive_float(value) / 1e3
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def add_serve_args(srv: argparse.ArgumentParser) -> None:
    """``kiln bench serve``'s flags."""
    srv.add_argument("--url", default=None, help="a running server (default: start `kiln serve` here)")
    src = srv.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="without --url: the model to serve (as `kiln serve --model`); "
                     "with --url: the model name sent in requests (default: the server's first model)")
    src.add_argument("--engine", default=None, help="without --url: a Kiln engine folder to serve "
                     "(as `kiln serve --engine`)")
    srv.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                     help="without --url: the started server's --load-format (dummy: random weights, e.g. "
                          "builtin:llama-3.1-8b)")
    srv.add_argument("--max-num-seqs", type=positive_int, default=None,
                     help="without --url: the started server's --max-num-seqs (default: kiln serve's)")
    srv.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                     help="without --url: the started server's --kv-cache-dtype (default: kiln serve's, auto)")
    add_workload_args(srv, (128, 64, 0.5))
    srv.add_argument("--vocab-size", type=positive_int, default=None,
                     help="prompt token ids are below this (default: the started model's vocabulary; with --url "
                          f"{DEFAULT_URL_VOCAB_SIZE})")
    srv.add_argument("--max-concurrency", "--concurrency", dest="concurrency", type=_int_list, default=None,
                     metavar="N[,N...]", help="requests in flight at most; a list (1,8,64,256) runs one benchmark "
                     f"per value, one table (default: {DEFAULT_CONCURRENCY} at an infinite rate, else no limit)")
    srv.add_argument("--request-rate", type=_rate_list, default=[math.inf], metavar="R[,R...]",
                     help="requests per second, arriving as a Poisson process (inf: all at once; default); a "
                          "list runs one benchmark per value")
    srv.add_argument("--burstiness", type=_positive_float, default=1.0,
                     help="shape of the gamma inter-arrival times with --request-rate: 1 = Poisson (default), "
                          "<1 burstier, >1 more regular")
    srv.add_argument("--goodput", type=_slo, nargs="+", default=None, metavar="METRIC:MS",
                     help=f"SLOs in milliseconds ({', '.join(SLO_KEYS)}), e.g. ttft:500 tpot:50; reports goodput, "
                          "the requests per second that meet all of them")
    srv.add_argument("--json", default=None, help="write the arguments and every run's results here")


def check_serve_flags(ns: argparse.Namespace) -> dict[str, float]:
    """Validate flag combinations before anything starts; returns the SLOs (seconds).

    Raises:
        ValueError: a combination that cannot run (one line for the user).
    """
    if ns.url and ns.engine:
        raise ValueError("--engine starts a server here; it cannot be used with --url")
    if ns.url and (ns.load_format or ns.max_num_seqs is not None or ns.kv_cache_dtype):
        raise ValueError("--load-format, --max-num-seqs and --kv-cache-dtype configure the server started here; "
                         "they cannot be used with --url")
    if ns.engine and ns.load_format == "dummy":
        raise ValueError("--load-format dummy applies to a --model, not to an engine")
    if ns.burstiness != 1.0 and all(math.isinf(r) for r in ns.request_rate):
        raise ValueError("--burstiness shapes the arrivals of --request-rate; give a finite rate")
    check_workload_flags(ns)
    slos: dict[str, float] = {}
    for key, seconds in ns.goodput or ():
        if key in slos:
            raise ValueError(f"--goodput names {key} twice")
        slos[key] = seconds
    if ns.json:
        check_writable(ns.json)
    return slos


# -- the command -----------------------------------------------------------------------------
def _vocab_size(ns: argparse.Namespace) -> int:
    """Prompt ids are below this: ``--vocab-size``, else the vocabulary of the model or engine
    started here, else ``DEFAULT_URL_VOCAB_SIZE``."""
    if ns.vocab_size:
        return ns.vocab_size
    if ns.url:
        return DEFAULT_URL_VOCAB_SIZE
    if ns.engine:
        from .engine_folder import open_engine  # noqa: PLC0415

        return open_engine(ns.engine, verify=False).model_config.vocab_size
    from . import loader  # noqa: PLC0415

    return loader.load_model_config(loader.resolve_source(ns.model)).vocab_size


def server_args(ns: argparse.Namespace, port: int) -> list[str]:
    """The ``kiln serve`` arguments of the server started here (without --url)."""
    args = ["--host", "127.0.0.1", "--port", str(port)]
    args += ["--model", ns.model] if ns.model else ["--engine", ns.engine] if ns.engine else []
    if ns.load_format:
        args += ["--load-format", ns.load_format]
    if ns.max_num_seqs is not None:  # else serve's default (capped by an engine's build limit)
        args += ["--max-num-seqs", str(ns.max_num_seqs)]
    if ns.kv_cache_dtype:
        args += ["--kv-cache-dtype", ns.kv_cache_dtype]
    return args


def _start_server(ns: argparse.Namespace):
    """Start ``kiln serve`` on a free local port; returns ``(process, url)``, or ``(None, exit
    code)`` when it did not start (its error is already printed)."""
    import subprocess  # noqa: PLC0415

    from .demo import free_port, wait_ready  # noqa: PLC0415

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.runtime.cli", "--log-level", "WARNING", "serve",
                             *server_args(ns, port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except RuntimeError as e:  # it exited (kiln serve printed why) or never became ready
        code = proc.poll()
        proc.kill()
        proc.wait()
        print(f"kiln bench: error: the server did not start: {e}"
              + (" (its error is above)" if code is not None else ""), file=sys.stderr)
        return None, 2 if code == 2 else 1  # kiln serve exits 2 on bad input
    return proc, url


def cmd_serve(ns: argparse.Namespace) -> int:
    """Run ``kiln bench serve``; returns the exit code (1: a request failed; 2: bad flags, a
    ``--url`` that cannot be reached or used, or a server that refused the flags)."""
    slos = check_serve_flags(ns)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    proc, url = (None, ns.url) if ns.url else _start_server(ns)
    if proc is None and not ns.url:
        return url
    try:
        vocab = _vocab_size(ns)  # after the start: kiln serve has checked the model
        served = served_model(url)  # also checks that the server answers
        model = ns.model if ns.url and ns.model else served  # without --url, --model is the source served here
        wl = workload_from_flags(ns, vocab)
        # progress on stderr: stdout is one JSON line per run, then the table
        print(f"[bench] {url} model {model}: {describe_workload(ns, wl)}", file=sys.stderr, flush=True)
        rows = []
        concurrencies = ns.concurrency or [None]
        for rate, conc in itertools.product(ns.request_rate, concurrencies):
            conc = DEFAULT_CONCURRENCY if conc is None and math.isinf(rate) else conc
            results, wall = asyncio.run(run_load(url, model, wl, rate, conc, ns.burstiness, ns.seed))
            rows.append(summarize(results, wall, rate, conc, slos))
            rows[-1]["client_cpu_share"] = CLIENT_CPU["seconds"] / wall
            print(json.dumps(json_safe(rows[-1])), flush=True)
        print_table(rows)
        _report_problems(rows)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(ns).items() if k not in ("func", "workload_defaults")},
                           "results": [json_safe(r) for r in rows]}, f, indent=2)
        return 0 if not any(r["errors"] for r in rows) else 1
    except BenchError as e:
        print(f"kiln bench: error: {e}", file=sys.stderr)
        return 2
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)


def _report_problems(rows: list[dict]) -> None:
    """Failed requests and streams that delivered everything at once, on stderr."""
    for r in rows:
        where = f"concurrency {r['concurrency'] or '-'}, rate {r['request_rate'] or 'inf'}"
        if r["errors"]:
            print(f"kiln bench: {r['errors']} of {r['requests']} requests failed ({where}); the first: "
                  f"{r['first_error']}", file=sys.stderr)
        if r["bulk_streams"]:
            print(f"kiln bench: warning: {r['bulk_streams']} of {r['requests'] - r['errors']} streams delivered all "
                  f"their tokens in one chunk ({where}): TTFT, TPOT and ITL measure nothing for them (a model "
                  "without a tokenizer streams no text until the end)", file=sys.stderr)
