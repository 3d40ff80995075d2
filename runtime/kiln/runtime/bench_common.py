"""What ``kiln bench offline`` and ``kiln bench serve`` share: workloads (token-id prompts and
output lengths), percentiles, JSON output and the flag types.

Workloads follow vLLM's benchmark scripts: random token-id prompts, EOS ignored so every
request produces its output length.  Lengths are fixed (``--input-len/--output-len``), uniform
around them (``--range-ratio``), or lognormal (``--dataset lognormal``), a heavy-tailed mix like
chat traffic: by default the means of ShareGPT in the vLLM paper (Kwon et al., SOSP 2023,
Table 1: 161 prompt and 338 output tokens on average).
"""

from __future__ import annotations

import argparse
import math
import os
import random
from dataclasses import dataclass

# ShareGPT's mean lengths (tokens) in the vLLM paper, the lognormal mix's default means
SHAREGPT_MEAN_INPUT_LEN = 161
SHAREGPT_MEAN_OUTPUT_LEN = 338
# Spread of the lognormal mix: the standard deviation of log(length); 1.0 and 0.8 give a
# coefficient of variation of 1.3 and 0.95, a long tail of long prompts as in chat logs
LOGNORMAL_INPUT_SIGMA = 1.0
LOGNORMAL_OUTPUT_SIGMA = 0.8
LOGNORMAL_CLIP = 4  # lengths are capped at this multiple of their mean (a few % of requests)


@dataclass
class Workload:
    """Prompts as token ids and the output length of each (tokens)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int = 0, low_id: int = 100) -> Workload:
    """Random token-id prompts; lengths uniform in ``[len*(1-r), len*(1+r)]`` (tokens); ids
    uniform in ``[low_id, vocab_size)``."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        il = max(1, rng.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))))
        ol = max(1, rng.randint(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio))))
        prompts.append([rng.randrange(low_id, vocab_size) for _ in range(il)])
        outs.append(ol)
    return Workload(prompts, outs)


def lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float) -> list[int]:
    """``n`` lengths (tokens) of a lognormal distribution with the given mean and log-space
    standard deviation ``sigma``, rounded, in ``[1, LOGNORMAL_CLIP * mean]``."""
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2 / 2) = mean
    cap = max(1, int(LOGNORMAL_CLIP * mean))
    return [min(cap, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def make_lognormal_workload(num_prompts: int, mean_input_len: float, mean_output_len: float, vocab_size: int,
                            seed: int = 0, input_sigma: float = LOGNORMAL_INPUT_SIGMA,
                            output_sigma: float = LOGNORMAL_OUTPUT_SIGMA, low_id: int = 100) -> Workload:
    """Random token-id prompts with lognormal prompt and output lengths (``lognormal_lengths``)."""
    rng = random.Random(seed)
    ins = lognormal_lengths(rng, num_prompts, mean_input_len, input_sigma)
    outs = lognormal_lengths(rng, num_prompts, mean_output_len, output_sigma)
    return Workload([[rng.randrange(low_id, vocab_size) for _ in range(n)] for n in ins], outs)


# The copy workload's passages (held-out texts shipped with the runtime) and its instruction.
COPY_SOURCES = ("prose.txt", "code.txt", "markdown.txt")
COPY_INSTRUCTION = "Repeat the following text exactly, word for word.\n\n"
COPY_PRIMED_WORDS = 8  # words of the passage that open the answer


def make_copy_workload(tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> Workload:
    """A copy-heavy workload (editing, summarising and quoting repeat their prompt): each
    prompt asks to repeat a passage of about ``input_len`` tokens from the shipped held-out
    prose, code and markdown (``kiln/runtime/data/heldout``), through the tokenizer's chat
    template when it has one, and the answer already holds the passage's first
    ``COPY_PRIMED_WORDS`` words; ``output_len`` tokens each.  Prompt lookup (n-gram) speculation
    is measured on this.

    Raises:
        ValueError: without a tokenizer (token-id-only models).
    """
    from pathlib import Path  # noqa: PLC0415

    if tokenizer is None:
        raise ValueError("--dataset copy needs the model's tokenizer; this model has none")
    root = Path(__file__).parent / "data" / "heldout"
    paras = [p.strip() for name in COPY_SOURCES for p in (root / name).read_text().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        start = rng.randrange(len(paras))
        text, n = [], 0
        for p in paras[start:] + paras[:start]:
            text.append(p)
            n += len(tokenizer.encode(p))
            if n >= input_len:
                break
        passage = "\n\n".join(text)
        msg = COPY_INSTRUCTION + passage
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                                tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = list(tokenizer.encode(msg + "\n\n"))
        # the answer has begun: its first words are the passage's (an editor's reply in progress)
        prompts.append(ids + list(tokenizer.encode(" ".join(passage.split(" ")[:COPY_PRIMED_WORDS]))))
    return Workload(prompts, [output_len] * num_prompts)


def workload_from_flags(ns: argparse.Namespace, vocab_size: int, tokenizer=None) -> Workload:
    """The workload of ``--dataset`` (after ``check_workload_flags``): ``random`` lengths
    around ``--input-len/--output-len`` (``--range-ratio``), ``lognormal`` with those means,
    or ``copy`` (``make_copy_workload``; needs ``tokenizer``)."""
    if ns.dataset == "copy":
        return make_copy_workload(tokenizer, ns.num_prompts, ns.input_len, ns.output_len, ns.seed)
    if ns.dataset == "lognormal":
        return make_lognormal_workload(ns.num_prompts, ns.input_len, ns.output_len, vocab_size, ns.seed)
    return make_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, vocab_size, ns.seed)


def describe_workload(ns: argparse.Namespace, wl: Workload) -> str:
    """One line on the workload: its kind, lengths and token totals."""
    n = len(wl.prompts)
    kind = {"lognormal": "lognormal lengths", "copy": "copy a given passage"}.get(
        ns.dataset, f"random lengths (range {ns.range_ratio})")
    return (f"{n} prompts, {kind}: input mean {wl.num_input_tokens / n:.0f} max {max(map(len, wl.prompts))}, "
            f"output mean {wl.num_output_tokens / n:.0f} max {max(wl.output_lens)} tokens; "
            f"{wl.num_output_tokens} output tokens requested")


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile (linear interpolation) of ``xs``; NaN for no samples."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def json_safe(d: dict) -> dict:
    """``d`` with non-finite floats (a percentile of no samples is NaN) as None: JSON null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}


def check_writable(path: str) -> None:
    """Raise ValueError unless ``path`` can be written (before the benchmark runs, not after)."""
    existed = os.path.exists(path)
    try:
        open(path, "a").close()
    except OSError as e:
        raise ValueError(f"cannot write --json {path}: {e.strerror}") from None
    if not existed:
        os.remove(path)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def ratio(text: str) -> float:
    """argparse type: a length spread in [0, 1)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {v}")
    return v


def add_workload_args(p: argparse.ArgumentParser, defaults: tuple[int, int, float], seed: bool = True) -> None:
    """``--num-prompts``, ``--dataset``, ``--input-len``, ``--output-len``, ``--range-ratio``
    (and ``--seed`` unless the parser has it); ``defaults`` are the random dataset's input and
    output lengths (tokens) and range ratio."""
    il, ol, rr = defaults
    p.add_argument("--num-prompts", type=positive_int, default=64, help="requests per run (default: %(default)s)")
    p.add_argument("--dataset", choices=["random", "lognormal", "copy"], default="random",
                   help="random: lengths uniform around --input-len/--output-len (--range-ratio); lognormal: "
                        "a heavy-tailed chat-like mix with those means (default: ShareGPT's, "
                        f"{SHAREGPT_MEAN_INPUT_LEN} / {SHAREGPT_MEAN_OUTPUT_LEN} tokens); copy: repeat a "
                        "passage of about --input-len tokens of shipped text (speculative decoding)")
    p.add_argument("--input-len", type=positive_int, default=None, help=f"prompt tokens (random default: {il})")
    p.add_argument("--output-len", type=positive_int, default=None,
                   help=f"generated tokens per request, EOS ignored (random default: {ol})")
    p.add_argument("--range-ratio", type=ratio, default=None,
                   help=f"random dataset: 0 = fixed lengths, 0.5 = uniform +-50%% (default: {rr})")
    if seed:
        p.add_argument("--seed", type=int, default=0, help="the workload's random seed")
    p.set_defaults(workload_defaults=defaults)


def check_workload_flags(ns: argparse.Namespace) -> None:
    """Fill the length defaults of ``--dataset``; ValueError for ``--range-ratio`` with the
    lognormal mix (it has its own spread)."""
    il, ol, rr = ns.workload_defaults
    if ns.dataset == "copy" and ns.range_ratio:
        raise ValueError("--range-ratio applies to --dataset random; copy prompts take their passage's length")
    if ns.dataset == "lognormal":
        if ns.range_ratio is not None:
            raise ValueError("--range-ratio applies to --dataset random; the lognormal mix has its own spread")
        ns.input_len = ns.input_len or SHAREGPT_MEAN_INPUT_LEN
        ns.output_len = ns.output_len or SHAREGPT_MEAN_OUTPUT_LEN
        return
    ns.input_len, ns.output_len = ns.input_len or il, ns.output_len or ol
    ns.range_ratio = rr if ns.range_ratio is None else ns.range_ratio
