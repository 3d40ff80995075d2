"""``kiln bench``: offline throughput (with transformers as the peer in the same run) and
online serving latency (TTFT, TPOT, end-to-end percentiles) against a live server.

Workloads follow vLLM's benchmark scripts: random token-id prompts of fixed lengths
(``--input-len/--output-len``) or a random-length mix (``--range-ratio``), EOS ignored so
every request produces its ``output_len`` tokens.  The transformers peer runs the same
prompts: batched ``generate`` with left padding on CPU (vLLM's ``run_hf``: each batch runs
to its longest request, only requested tokens are counted) or continuous batching
(``generate_batch``) on CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass


@dataclass
class Workload:
    """Prompts as token ids and the output length of each (tokens)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int = 0, low_id: int = 100) -> Workload:
    """Random token-id prompts; lengths uniform in ``[len*(1-r), len*(1+r)]`` (tokens)."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        il = max(1, rng.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))))
        ol = max(1, rng.randint(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio))))
        prompts.append([rng.randrange(low_id, vocab_size) for _ in range(il)])
        outs.append(ol)
    return Workload(prompts, outs)


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _json_safe(d: dict) -> dict:
    """``d`` with non-finite floats (a percentile of no samples is NaN) as None: JSON null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}


def run_kiln_offline(llm, wl: Workload) -> dict:
    from .sampling_params import SamplingParams  # noqa: PLC0415

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False) for o in wl.output_lens]
    # Warm up (kernels, allocator) outside the timed region.
    llm.generate([wl.prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))
    _sync(llm)
    steps0, pre0 = llm.engine.num_steps, llm.engine.scheduler.num_preemptions_total
    t0 = time.perf_counter()
    t0m = time.monotonic()
    outs = llm.generate(wl.prompts, params)
    _sync(llm)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics["first_token_time"] - t0m for o in outs if "first_token_time" in o.metrics]
    tpot = []
    for o in outs:
        n = len(o.outputs[0].token_ids)
        if n > 1 and "first_token_time" in o.metrics:
            tpot.append((o.metrics["last_token_time"] - o.metrics["first_token_time"]) / (n - 1))
    return {"engine": "kiln", "wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall,
            "requests_s": len(outs) / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99), "steps": llm.engine.num_steps - steps0,
            "preemptions": llm.engine.scheduler.num_preemptions_total - pre0}


def _sync(llm) -> None:
    import torch  # noqa: PLC0415

    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def build_hf_peer(llm):
    """A transformers model holding exactly the Kiln model's weights (same dtype/device)."""
    import torch  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    from .model.llama import to_hf_state_dict  # noqa: PLC0415

    runner = llm.engine.runner
    cfg = AutoConfig.for_model(**{k: v for k, v in llm.engine.model_config.to_hf_dict().items()
                                  if k not in ("architectures",)})
    with torch.device(runner.device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=runner.dtype)
    sd = to_hf_state_dict(runner.model)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary" not in m and not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"peer weights mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.eval()
    return hf


def run_hf_offline(hf, wl: Workload, batch_size: int, device) -> dict:
    """transformers' batched ``generate`` (vLLM ``run_hf`` style) on the same prompts."""
    import torch  # noqa: PLC0415

    pad = 0
    n_done = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(wl.prompts), batch_size):
            batch = wl.prompts[i : i + batch_size]
            outs = wl.output_lens[i : i + batch_size]
            L = max(len(p) for p in batch)
            ids = torch.full((len(batch), L), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), L), dtype=torch.long)
            for j, p in enumerate(batch):
                ids[j, L - len(p):] = torch.tensor(p)
                mask[j, L - len(p):] = 1
            new = max(outs)
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad, use_cache=True)
            n_done += sum(outs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"engine": "transformers.generate", "wall_s": wall, "output_tokens": n_done,
            "output_tok_s": n_done / wall, "requests_s": len(wl.prompts) / wall}


def run_hf_continuous(hf, wl: Workload) -> dict:
    """transformers' continuous batching (``generate_batch``) on the same prompts (CUDA)."""
    import torch  # noqa: PLC0415
    from transformers import GenerationConfig  # noqa: PLC0415

    gc = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0,
                          use_cuda_graph=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = hf.generate_batch(inputs=wl.prompts, generation_config=gc, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = sum(min(len(r.generated_tokens), o) for r, o in zip(res.values(), wl.output_lens))
    return {"engine": "transformers.generate_batch", "wall_s": wall, "output_tokens": n,
            "output_tok_s": n / wall, "requests_s": len(wl.prompts) / wall}


def _check_writable(path: str) -> None:
    """Raise ValueError unless ``path`` can be written (before the benchmark runs, not after)."""
    existed = os.path.exists(path)
    try:
        open(path, "a").close()
    except OSError as e:
        raise ValueError(f"cannot write --json {path}: {e.strerror}") from None
    if not existed:
        os.remove(path)


def cmd_offline(ns: argparse.Namespace) -> int:
    from .cli import engine_args_from  # noqa: PLC0415
    from .llm import LLM  # noqa: PLC0415

    if ns.json:
        _check_writable(ns.json)
    args = engine_args_from(ns)
    llm = LLM(**{k: v for k, v in vars(args).items()})
    wl = make_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio,
                       llm.engine.model_config.vocab_size, ns.seed)
    runner = llm.engine.runner
    print(f"[bench] model {llm.engine.model_ref} on {runner.device}/{runner.dtype}; {ns.num_prompts} prompts, "
          f"input {ns.input_len} output {ns.output_len} range {ns.range_ratio}; "
          f"{wl.num_output_tokens} output tokens requested", flush=True)
    results = [run_kiln_offline(llm, wl)]
    print(json.dumps(_json_safe(results[-1])), flush=True)
    if ns.peer != "none":
        hf = build_hf_peer(llm)
        if ns.peer == "transformers-cb":
            results.append(run_hf_continuous(hf, wl))
        else:
            results.append(run_hf_offline(hf, wl, ns.peer_batch_size, runner.device))
        print(json.dumps(_json_safe(results[-1])), flush=True)
        results.append({"ratio_kiln_over_peer": results[0]["output_tok_s"] / results[1]["output_tok_s"]})
    _print_table(results)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(ns).items() if k != "func"},
                       "results": [_json_safe(r) for r in results]}, f, indent=2)
    return 0


def _print_table(results: list[dict]) -> None:
    print(f"{'engine':32s} {'out tok/s':>10s} {'req/s':>8s} {'wall s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'TPOT p50':>9s} {'TPOT p99':>9s}")
    for r in results:
        if "engine" not in r:
            print(" ".join(f"{k}={v:.2f}" for k, v in r.items()))
            continue
        f = lambda k: f"{r[k] * 1e3:8.1f}ms" if k in r and r[k] == r[k] else f"{'-':>10s}"  # noqa: E731
        print(f"{r['engine']:32s} {r['output_tok_s']:10.1f} {r['requests_s']:8.2f} {r['wall_s']:8.1f} "
              f"{f('ttft_p50_s')}{f('ttft_p99_s')}{f('tpot_p50_s')}{f('tpot_p99_s')}")


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, not an OpenAI-style server)."""


def _error_reason(status: int, body: bytes) -> str:
    """``"<status>: <message>"`` from an OpenAI-style error body ``{"error": {"message": ...}}``
    (else the start of the raw body)."""
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode("utf-8", "replace").strip()[:300]
    return f"{status}: {msg}" if msg else str(status)


def _served_model(url: str) -> str:
    """The first model the server at ``url`` lists at /v1/models.  Raises BenchError."""
    import httpx  # noqa: PLC0415

    try:
        r = httpx.get(f"{url}/v1/models", timeout=30)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach the server at {url}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"the server at {url} answered GET /v1/models with {_error_reason(r.status_code, r.content)}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"the server at {url} does not list a model at /v1/models (not an OpenAI-style server?)") \
            from None


async def _serve_one(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: ``{"ttft", "e2e", "tokens", "tpot"}``, or ``{"error": reason}``."""
    import httpx  # noqa: PLC0415

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    n = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return {"error": _error_reason(r.status_code, await r.aread())}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return {"error": _error_reason(r.status_code, line[6:].encode())}
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                elif ttft is None and chunk["choices"]:
                    ttft = time.perf_counter() - t0
    except httpx.TransportError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    e2e = time.perf_counter() - t0
    return {"ttft": ttft or e2e, "e2e": e2e, "tokens": n, "tpot": (e2e - (ttft or e2e)) / max(1, n - 1)}


def cmd_serve(ns: argparse.Namespace) -> int:
    import httpx  # noqa: PLC0415

    if ns.url and ns.engine:
        raise ValueError("--engine starts a server here; it cannot be used with --url")
    proc = None
    url = ns.url
    if not url:
        import subprocess  # noqa: PLC0415

        from .demo import free_port, wait_ready  # noqa: PLC0415

        port = free_port()
        extra = ["--model", ns.model] if ns.model else ["--engine", ns.engine] if ns.engine else []
        if ns.max_num_seqs is not None:  # else serve's default (capped by an engine's build limit)
            extra += ["--max-num-seqs", str(ns.max_num_seqs)]
        proc = subprocess.Popen([sys.executable, "-m", "kiln.runtime.cli", "--log-level", "WARNING", "serve",
                                 "--host", "127.0.0.1", "--port", str(port), *extra])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
        except RuntimeError as e:  # it exited (kiln serve printed why) or never became ready
            code = proc.poll()
            proc.kill()
            proc.wait()
            print(f"kiln bench: error: the server did not start: {e}"
                  + (" (its error is above)" if code is not None else ""), file=sys.stderr)
            return 2 if code == 2 else 1  # kiln serve exits 2 on bad input
    try:
        served = _served_model(url)  # also checks that the server answers
        model = ns.model if ns.url and ns.model else served  # without --url, --model is the source served here
        wl = make_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, ns.vocab_size, ns.seed)

        async def main():
            sem = asyncio.Semaphore(ns.concurrency)
            limits = httpx.Limits(max_connections=ns.concurrency + 8)
            async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
                async def go(p, o):
                    async with sem:
                        return await _serve_one(client, f"{url}/v1/completions", model, p, o)
                t0 = time.perf_counter()
                res = await asyncio.gather(*(go(p, o) for p, o in zip(wl.prompts, wl.output_lens)))
                return res, time.perf_counter() - t0

        res, wall = asyncio.run(main())
        ok = [r for r in res if "error" not in r]
        toks = sum(r["tokens"] for r in ok)
        summary = {"engine": f"kiln serve (concurrency {ns.concurrency})", "wall_s": wall, "output_tokens": toks,
                   "output_tok_s": toks / wall, "requests_s": len(ok) / wall, "errors": len(res) - len(ok),
                   "ttft_p50_s": pct([r["ttft"] for r in ok], 50), "ttft_p99_s": pct([r["ttft"] for r in ok], 99),
                   "tpot_p50_s": pct([r["tpot"] for r in ok], 50), "tpot_p99_s": pct([r["tpot"] for r in ok], 99),
                   "e2e_p50_s": pct([r["e2e"] for r in ok], 50), "e2e_p99_s": pct([r["e2e"] for r in ok], 99),
                   "first_error": next((r["error"] for r in res if "error" in r), None)}
        if summary["errors"]:
            print(f"kiln bench: {summary['errors']} of {len(res)} requests failed; the first: {summary['first_error']}",
                  file=sys.stderr)
        print(json.dumps(_json_safe(summary)))
        _print_table([summary])
        return 0 if not summary["errors"] else 1
    except BenchError as e:
        print(f"kiln bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _ratio(text: str) -> float:
    """argparse type: a length spread in [0, 1)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {v}")
    return v


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """``kiln bench offline ...`` and ``kiln bench serve ...``."""
    from .cli import add_engine_args  # noqa: PLC0415

    sub = p.add_subparsers(dest="mode", required=True)
    off = sub.add_parser("offline", help="offline throughput of LLM.generate (+ transformers peer)")
    add_engine_args(off)
    for q in (off,):
        q.add_argument("--num-prompts", type=_positive_int, default=64)
        q.add_argument("--input-len", type=_positive_int, default=128, help="prompt tokens")
        q.add_argument("--output-len", type=_positive_int, default=128, help="generated tokens")
        q.add_argument("--range-ratio", type=_ratio, default=0.0, help="0 = fixed lengths; 0.5 = uniform +-50%%")
        q.add_argument("--peer", choices=["none", "transformers", "transformers-cb"], default="none")
        q.add_argument("--peer-batch-size", type=_positive_int, default=64)
        q.add_argument("--json", default=None, help="write results here")
    srv = sub.add_parser("serve", help="latency percentiles against a live server")
    srv.add_argument("--url", default=None, help="a running server (default: start `kiln serve` here)")
    src = srv.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="without --url: the model to serve (as `kiln serve --model`); "
                     "with --url: the model name sent in requests (default: the server's first model)")
    src.add_argument("--engine", default=None, help="without --url: a Kiln engine folder to serve "
                     "(as `kiln serve --engine`)")
    srv.add_argument("--max-num-seqs", type=_positive_int, default=None,
                     help="the started server's --max-num-seqs (default: kiln serve's)")
    srv.add_argument("--num-prompts", type=_positive_int, default=64)
    srv.add_argument("--concurrency", type=_positive_int, default=16)
    srv.add_argument("--input-len", type=_positive_int, default=128)
    srv.add_argument("--output-len", type=_positive_int, default=64)
    srv.add_argument("--range-ratio", type=_ratio, default=0.5)
    srv.add_argument("--vocab-size", type=_positive_int, default=49152)
    srv.add_argument("--seed", type=int, default=0)


def run_bench(ns: argparse.Namespace) -> int:
    """Run ``kiln bench offline ...`` or ``kiln bench serve ...``; returns the exit code."""
    return cmd_offline(ns) if ns.mode == "offline" else cmd_serve(ns)
