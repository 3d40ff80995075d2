"""``kiln eval``: accuracy of a model or an engine.

* ``kiln eval perplexity (--model SRC | --engine DIR) [--text FILE]`` prints perplexity and the
  number of scored tokens.  The text is tokenized without special tokens and cut into
  non-overlapping windows of ``--window`` tokens; every token but a window's first is scored
  (``ppl = exp(sum NLL / count)``).  The forward pass is Kiln's own (paged KV cache included,
  so an FP8 KV cache is measured too).  Default text: the shipped held-out text
  (``data/heldout.txt``), disjoint from the calibration text.
* ``kiln eval perplexity (--model SRC | --engine DIR) --domains [all | prose,code,...]`` scores
  each held-out domain shipped in ``data/heldout/`` (prose, dialogue through the chat template,
  code, markdown and numbers, multilingual) and ``docstrings`` (``data/heldout.txt``), each
  text on its own, with one model load, and prints one line per domain (``--json``: one
  object).  ``--text`` may be repeated, and a ``.jsonl`` text is read as calibration-style
  records (``{"text"}`` or ``{"messages"}``, chats through the chat template); each text is
  then a domain named by its file name.
* ``kiln eval agreement A B [--text FILE]`` compares two models/engines (each a source or an
  engine folder): teacher-forced top-1 agreement over the text, and greedy generations from
  prompts cut from it (share of identical tokens, prompts identical to the end).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_WINDOW = 512


@dataclass
class PerplexityResult:
    """``perplexity`` = exp(``nll`` / ``num_tokens``); ``num_tokens`` scored tokens;
    ``nll`` summed negative log-likelihood in nats."""

    perplexity: float
    num_tokens: int
    nll: float


def _is_engine(ref: str) -> bool:
    from kiln.common.constants import MANIFEST_FILENAME  # noqa: PLC0415

    return Path(ref).is_dir() and (Path(ref) / MANIFEST_FILENAME).is_file()


def open_model(model: str | None = None, engine: str | None = None, device: str = "cpu", dtype: str = "auto",
               window: int = DEFAULT_WINDOW, num_seqs: int = 1, context: int = 0):
    """An ``LLMEngine`` for a source or an engine folder, with a KV pool just large enough for
    ``num_seqs`` sequences of ``max(window, context)`` tokens (plus headroom)."""
    from .config import EngineArgs  # noqa: PLC0415
    from .engine import LLMEngine  # noqa: PLC0415

    blocks = num_seqs * (math.ceil(max(window, context) / 16) + 8)
    return LLMEngine(EngineArgs(model=model, engine=engine, device=device, dtype=dtype, num_kv_blocks=blocks,
                                max_num_seqs=max(num_seqs, 1), enable_cuda_graphs=False,
                                max_num_batched_tokens=max(2048, window),
                                # windows past the 4096 default up to the model's context (else a clear error)
                                max_model_len=window if window > 4096 else None))


def read_text(path: str | None) -> str:
    if path is None:
        from .quantization.calibration import data_path  # noqa: PLC0415

        return data_path("heldout.txt").read_text(encoding="utf-8")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") \
            from None


def score_windows(engine, ids: list[int], window: int = DEFAULT_WINDOW, want_argmax: bool = False):
    """Teacher-forced pass over ``ids`` in windows of ``window`` tokens.

    Returns:
        (PerplexityResult, argmax predictions int64 [num_tokens] or None).
    """
    import torch  # noqa: PLC0415

    from .quantization.calibration import single_sequence_meta  # noqa: PLC0415

    runner = engine.runner
    model = runner.model
    nll, count = 0.0, 0
    preds = []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            if len(chunk) < 2:
                break
            t = torch.tensor(chunk, dtype=torch.int64, device=runner.device)
            pos = torch.arange(len(chunk), dtype=torch.int64, device=runner.device)
            meta = single_sequence_meta(len(chunk), runner.block_size, runner.device)
            hidden = model(t, pos, meta)
            logits = model.compute_logits(hidden[:-1]).float()  # [n-1, vocab]
            nll += float(torch.nn.functional.cross_entropy(logits, t[1:], reduction="sum"))
            count += len(chunk) - 1
            if want_argmax:
                preds.append(logits.argmax(-1).cpu())
    res = PerplexityResult(math.exp(nll / max(count, 1)), count, nll)
    if not want_argmax:
        return res, None
    return res, (torch.cat(preds) if preds else torch.empty(0, dtype=torch.int64))


def perplexity(model: str | None = None, engine: str | None = None, text: str | None = None,
               max_tokens: int | None = None, window: int = DEFAULT_WINDOW, device: str = "cpu",
               dtype: str = "auto") -> PerplexityResult:
    """Perplexity of a source or engine on ``text`` (a file path, or the text itself;
    default: the shipped held-out text), first ``max_tokens`` tokens when given.

    Raises:
        ValueError: ``window`` < 2 or above the engine's ``max_model_len``, ``max_tokens`` < 2,
            a text that is not UTF-8, or a text too short to score a token.
    """
    if window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {window}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}")
    body = read_text(text) if text is None or Path(text).exists() else text  # bad text fails before loading
    if not body.strip():
        raise ValueError("the text is empty: nothing to score (need at least 2 tokens)")
    try:
        eng = open_model(model, engine, device, dtype, window)
    except ValueError as e:
        if window > 4096 and "max_model_len" in str(e):  # the window became the engine's max_model_len
            raise ValueError(f"--window {window} is longer than the model's context: {e}") from e
        raise
    if window > eng.max_model_len:  # positions past the context the engine serves
        raise ValueError(f"--window {window} is longer than the model's context of {eng.max_model_len} tokens "
                         f"(max_model_len); use --window {eng.max_model_len} or less")
    ids = list(eng.tokenizer(body, add_special_tokens=False)["input_ids"])
    if max_tokens:
        ids = ids[:max_tokens]
    res = score_windows(eng, ids, window)[0]
    if res.num_tokens == 0:
        raise ValueError(f"the text has {len(ids)} token(s): nothing to score (need at least 2)")
    return res


def domain_texts(domains: str | None = None, texts: list[str] | None = None) -> dict[str, str]:
    """``{domain: file}`` to score: the shipped held-out domains named in ``domains`` (``all``
    or comma-separated names), then each of ``texts`` under its file name (stem).

    Raises:
        ValueError: an unknown domain name, a missing text file, two texts with one name.
    """
    from .quantization.calibration_data import heldout_domains  # noqa: PLC0415

    shipped = heldout_domains()
    out: dict[str, str] = {}
    if domains:
        names = list(shipped) if domains.strip() == "all" else [d.strip() for d in domains.split(",") if d.strip()]
        for n in names:
            if n not in shipped:
                raise ValueError(f"--domains: unknown domain {n!r}; shipped: {', '.join(shipped)} (or all)")
            out[n] = str(shipped[n])
    for t in texts or []:
        if not Path(t).is_file():
            raise FileNotFoundError(f"--text {t}: no such file")
        name = Path(t).stem
        if name in out:
            raise ValueError(f"--text {t}: a second text named {name!r}; rename one of them")
        out[name] = t
    if not out:
        raise ValueError("nothing to score: give --domains or --text")
    return out


def perplexity_by_domain(files: dict[str, str], model: str | None = None, engine: str | None = None,
                         max_tokens: int | None = None, window: int = DEFAULT_WINDOW, device: str = "cpu",
                         dtype: str = "auto") -> dict[str, PerplexityResult]:
    """Perplexity on each text of ``{domain: file}`` (one model load; each text scored on its
    own in windows of ``window`` tokens; ``max_tokens`` caps each).  A ``.jsonl`` file is read
    as records (``calibration_data.read_records``: chats through the chat template, records
    joined by EOS); another file as plain text.

    Raises:
        ValueError: as ``perplexity``, or a malformed ``.jsonl`` (``CalibrationDataError``).
    """
    from .quantization.calibration_data import Record, domain_streams, read_records  # noqa: PLC0415

    if window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {window}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}")
    records = {}
    for dom, f in files.items():  # every file is read and checked before the model loads
        recs = read_records(f, default_domain=dom) if f.endswith(".jsonl") else [Record(dom, text=read_text(f))]
        records[dom] = [Record(dom, text=r.text, messages=r.messages) for r in recs]
    eng = open_model(model, engine, device, dtype, window)
    if window > eng.max_model_len:
        raise ValueError(f"--window {window} is longer than the model's context of {eng.max_model_len} tokens "
                         f"(max_model_len); use --window {eng.max_model_len} or less")
    out = {}
    for dom, recs in records.items():
        ids = domain_streams(recs, eng.tokenizer)[dom]
        if max_tokens:
            ids = ids[:max_tokens]
        res = score_windows(eng, ids, window)[0]
        if res.num_tokens == 0:
            raise ValueError(f"{files[dom]}: {len(ids)} token(s): nothing to score (need at least 2)")
        out[dom] = res
    return out


def agreement(a: str, b: str, text: str | None = None, max_tokens: int | None = 2048, num_prompts: int = 8,
              prompt_tokens: int = 32, new_tokens: int = 32, window: int = DEFAULT_WINDOW,
              device: str = "cpu") -> dict:
    """Greedy agreement of two models/engines (each a source or an engine folder).

    Returns:
        ``{"teacher_forced_top1": share of positions where both predict the same next token,
        "greedy_token_agreement": share of generated tokens equal position by position,
        "greedy_identical": prompts whose continuations are identical, "num_prompts", ...}``.
    Raises:
        ValueError: ``max_tokens`` < 2 (None: the whole text), ``num_prompts``,
            ``prompt_tokens`` or ``new_tokens`` < 1, or what ``perplexity`` refuses.
    """
    from .sampling_params import SamplingParams  # noqa: PLC0415

    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}")
    for flag, v in (("--num-prompts", num_prompts), ("--prompt-tokens", prompt_tokens), ("--new-tokens", new_tokens)):
        if v < 1:
            raise ValueError(f"{flag} must be at least 1, got {v}")

    # one sequence at a time (windows, then prompts one by one): the pool holds one, whatever
    # --num-prompts asks (it was sized for all of them and could exhaust the host's memory)
    engines = [open_model(engine=r, device=device, window=window, context=prompt_tokens + new_tokens)
               if _is_engine(r) else open_model(model=r, device=device, window=window,
                                                context=prompt_tokens + new_tokens) for r in (a, b)]
    ids = list(engines[0].tokenizer(read_text(text), add_special_tokens=False)["input_ids"])
    if max_tokens:
        ids = ids[:max_tokens]
    (ra, pa), (rb, pb) = (score_windows(e, ids, window, want_argmax=True) for e in engines)
    if ra.num_tokens == 0:
        raise ValueError(f"the text has {len(ids)} token(s): nothing to compare (need at least 2)")
    top1 = float((pa == pb).float().mean())
    stride = max(prompt_tokens, len(ids) // max(num_prompts, 1))
    prompts = [ids[i:i + prompt_tokens] for i in range(0, len(ids) - prompt_tokens, stride)][:num_prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    gens = []
    for e in engines:
        outs = []
        for i, p in enumerate(prompts):
            rid = e.add_request(None, p, sp)
            fin = None
            while e.has_unfinished_requests():
                for o in e.step():
                    if o.finished and o.request_id == rid:
                        fin = o
            outs.append(list(fin.outputs[0].token_ids))
        gens.append(outs)
    same = sum(x == y for ga, gb in zip(*gens) for x, y in zip(ga, gb))
    total = sum(min(len(ga), len(gb)) for ga, gb in zip(*gens))
    return {"a": a, "b": b, "teacher_forced_top1": top1, "greedy_token_agreement": same / max(total, 1),
            "greedy_identical": sum(ga == gb for ga, gb in zip(*gens)), "num_prompts": len(prompts),
            "new_tokens": new_tokens, "perplexity_a": ra.perplexity, "perplexity_b": rb.perplexity,
            "num_tokens": ra.num_tokens}


# -- CLI -------------------------------------------------------------------------------------
def add_eval_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``kiln eval``'s modes (``perplexity`` and ``agreement``) and their flags to ``p``."""
    sub = p.add_subparsers(dest="eval_command", required=True)
    pp = sub.add_parser("perplexity", help="perplexity and token count on a text file")
    g = pp.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="builtin:<name>, a .gguf file, a Hugging Face folder or hf://org/name[@revision]")
    g.add_argument("--engine", help="a Kiln engine folder (kiln build)")
    pp.add_argument("--text", default=None, action="append",
                    help="UTF-8 text file, or .jsonl records (default: the shipped held-out text); repeat to "
                         "score several texts, each on its own")
    pp.add_argument("--domains", default=None, nargs="?", const="all",
                    help="score the shipped held-out domains: all (no value) or a comma-separated list")
    pp.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    pp.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per scored window")
    pp.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    pp.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    pp.add_argument("--json", action="store_true", help="print one JSON object")
    pa = sub.add_parser("agreement", help="greedy agreement between two models or engines")
    pa.add_argument("a", help="engine folder or model source")
    pa.add_argument("b", help="engine folder or model source")
    pa.add_argument("--text", default=None)
    pa.add_argument("--max-tokens", type=int, default=2048)
    pa.add_argument("--num-prompts", type=int, default=8)
    pa.add_argument("--new-tokens", type=int, default=32)
    pa.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    return p


def run_eval(args: argparse.Namespace) -> int:
    """Run ``kiln eval ...``; returns the exit code (2 for a bad model/engine/text)."""
    from kiln.common.manifest import EngineFormatError  # noqa: PLC0415
    from .loader import ModelSourceError  # noqa: PLC0415
    from .model.config import UnsupportedModelError  # noqa: PLC0415

    try:
        text = getattr(args, "text", None)
        if args.eval_command == "perplexity" and (args.domains is not None or (text and len(text) > 1)
                                                  or (text and text[0].endswith(".jsonl"))):
            return _perplexity_domains(args)
        if isinstance(text, list):
            text = args.text = text[0]
        if text is not None and Path(text).is_dir():
            raise ValueError(f"--text {text}: is a directory, not a text file")
        if text is not None and not Path(text).exists():
            raise FileNotFoundError(f"--text {text}: no such file")
        if args.eval_command == "perplexity":
            r = perplexity(args.model, args.engine, args.text, args.max_tokens, args.window, args.device, args.dtype)
            if args.json:
                print(json.dumps({"source": args.model or args.engine, **asdict(r)}))
            else:
                print(f"perplexity {r.perplexity:.4f} over {r.num_tokens} tokens ({args.model or args.engine})")
            return 0
        r = agreement(args.a, args.b, args.text, args.max_tokens, args.num_prompts, new_tokens=args.new_tokens,
                      device=args.device)
        print(json.dumps(r, indent=2))
        return 0
    except (EngineFormatError, ModelSourceError, UnsupportedModelError, FileNotFoundError, ValueError) as e:
        print(f"kiln eval: error: {e}", file=sys.stderr)
        return 2


def _perplexity_domains(args: argparse.Namespace) -> int:
    """``kiln eval perplexity --domains ... / --text A --text B``: one line (or one JSON
    object) per domain.  Errors propagate to ``run_eval``."""
    for t in args.text or []:
        if Path(t).is_dir():
            raise ValueError(f"--text {t}: is a directory, not a text file")
    files = domain_texts(args.domains, args.text)
    res = perplexity_by_domain(files, args.model, args.engine, args.max_tokens, args.window, args.device, args.dtype)
    src = args.model or args.engine
    if args.json:
        print(json.dumps({"source": src, "domains": {d: asdict(r) for d, r in res.items()}}))
    else:
        for d, r in res.items():
            print(f"{d:<14} perplexity {r.perplexity:.4f} over {r.num_tokens} tokens ({src})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kiln.runtime.eval perplexity ...``."""
    parser = add_eval_args(argparse.ArgumentParser(prog="kiln eval"))
    return run_eval(parser.parse_args(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
