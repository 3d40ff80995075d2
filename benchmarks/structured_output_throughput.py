"""Throughput cost of constrained decoding: generated tokens/s at batch 1 and 64 with and
without a JSON schema, offline (``LLM``), same prompt, same number of tokens per sequence.

    .venv/bin/python benchmarks/structured_output_throughput.py                 # embedded SmolLM2, CPU
    PYTHONPATH=common:runtime:kernels python3 benchmarks/structured_output_throughput.py \\
        --model builtin:llama-3.1-8b --load-format dummy                        # the H200 (< 4 min)

With ``--load-format dummy`` the builtin shape-only models use Kiln's synthetic byte-level
tokenizer (its whole 128256-token vocabulary), so the masks are the real size.  The schema
(an object with a title and an array of at least 64 free strings: the shape of a typical
extraction answer) keeps every row constrained for all ``--max-tokens`` steps, and the
unconstrained run ignores EOS, so both generate ``batch x max_tokens`` tokens; every
constrained output is checked token by token against the schema's grammar.  Each figure
is the best of ``--repeats`` timed runs after a warm-up (which also compiles the grammar).
Prints, per constrained run, the step time and the host time of the grammar's work in it:
the bitmask fill (on its worker thread), the part of it the step loop waited for before
launching the sampler ("not overlapped": the fill the forward pass and the planning of the
next step did not hide), the token accepts and the bitmask apply (on CUDA: its launch);
then one line per (batch, constrained) with tokens/s, and the cost in percent.
"""

from __future__ import annotations

import argparse
import time

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "items": {"type": "array", "items": {"type": "string"}, "minItems": 64},
}, "required": ["title", "items"]}
PROMPT = "List sixty-four fruits as JSON, with a title:"


HOST = {"accept": 0.0, "apply": 0.0}


def time_grammar_work() -> None:
    """Add the seconds the step loop spends in token accepts and in the sampler's bitmask
    apply (on CUDA: its launch) to ``HOST`` (the fill's times are the filler's own counts)."""
    from kiln.runtime import sampler  # noqa: PLC0415
    from kiln.runtime.structured_output.manager import StructuredOutputManager as M  # noqa: PLC0415

    def timed(owner, name, key):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                HOST[key] += time.perf_counter() - t0
        setattr(owner, name, wrapper)

    timed(M, "accept", "accept")
    timed(sampler, "apply_token_bitmask", "apply")


def filler_counts(llm) -> tuple[int, float, float]:
    """The engine's bitmask filler: (fills, fill seconds, seconds waited for a fill)."""
    so = llm.engine.core.grammars.manager
    f = so.filler if so is not None else None
    return (f.num_fills, f.fill_seconds, f.wait_seconds) if f is not None else (0, 0.0, 0.0)


def grammar_checker(llm, so_params):
    """A function that raises SystemExit unless every output's tokens are, in order, legal
    under the schema (a fresh grammar state per output, compiled apart from the engine's)."""
    from kiln.runtime.structured_output.backend import GrammarCompilerCache, GrammarState  # noqa: PLC0415

    core = llm.engine.core
    compiled = GrammarCompilerCache(llm.tokenizer, core.model_config.vocab_size,
                                    sorted(core.eos_token_ids)).get(so_params.spec())

    def check(outs) -> None:
        for o in outs:
            toks = list(o.outputs[0].token_ids)
            n = GrammarState(compiled).accept_tokens(toks)
            if n != len(toks):
                raise SystemExit(f"token {n} of output {o.request_id} ({toks[n]}) is outside the grammar: the mask "
                                 "was not applied to its row")
    return check


def measure(llm, batch: int, max_tokens: int, repeats: int) -> dict[bool, float]:
    """Best generated tokens/s, unconstrained and constrained, of ``repeats`` runs each of
    ``batch`` copies of the prompt (the two alternate, so a change in the machine's load
    falls on both)."""
    from kiln.runtime import SamplingParams  # noqa: PLC0415
    from kiln.runtime.sampling_params import StructuredOutputsParams  # noqa: PLC0415

    params = {c: SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not c,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA) if c else None)
              for c in (False, True)}
    for p in params.values():
        llm.generate([PROMPT] * batch, p)  # warm-up (and the grammar's compile)
    check = grammar_checker(llm, params[True].structured_outputs)
    best = {False: 0.0, True: 0.0}
    for _ in range(repeats):
        for c, p in params.items():
            HOST.update(accept=0.0, apply=0.0)
            f0 = filler_counts(llm)
            t0 = time.perf_counter()
            outs = llm.generate([PROMPT] * batch, p)
            dt = time.perf_counter() - t0
            n, fill, wait = (b - a for a, b in zip(f0, filler_counts(llm)))
            if c and n:
                print(f"  batch {batch} constrained run: {1e3 * dt / n:.1f} ms per step; bitmask fill "
                      f"{1e3 * fill / n:.2f} ms (worker thread), of it not overlapped {1e3 * wait / n:.2f} ms; accept "
                      f"{1e3 * HOST['accept'] / n:.2f} ms, apply {1e3 * HOST['apply'] / n:.2f} ms", flush=True)
            if c:
                check(outs)
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            if ntok != batch * max_tokens:
                raise SystemExit(f"batch {batch} constrained={c}: {ntok} tokens, expected {batch * max_tokens} "
                                 "(a sequence ended early: the comparison would be unfair)")
            best[c] = max(best[c], ntok / dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--load-format", default=None)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import torch  # noqa: PLC0415
    from importlib.metadata import version  # noqa: PLC0415

    from kiln.runtime import LLM  # noqa: PLC0415

    time_grammar_work()
    kw = {"model": a.model} if a.model else {}
    if a.load_format:
        kw["load_format"] = a.load_format
    t0 = time.perf_counter()
    llm = LLM(**kw)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{a.model or 'builtin:smollm2-135m-instruct'} on {dev}, xgrammar {version('xgrammar')}, "
          f"loaded in {time.perf_counter() - t0:.1f} s; {a.max_tokens} tokens per sequence", flush=True)
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        rates = measure(llm, bs, a.max_tokens, a.repeats)
        for constrained in (False, True):
            print(f"batch {bs:3d} constrained={constrained!s:5}  {rates[constrained]:9.1f} tokens/s", flush=True)
        print(f"batch {bs:3d} cost of constraining: {100 * (1 - rates[True] / rates[False]):5.1f} %", flush=True)


if __name__ == "__main__":
    main()
