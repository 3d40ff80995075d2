"""Where a speculative step's time goes: the engine core's phases (n-gram / placeholder
planning, scheduling, the proposer's drafting, the target's verify, output processing) timed
with the device synchronized around each, per method and batch size, on a copy workload.

The synchronization serializes what asynchronous scheduling would overlap, so the phases add
up to more than a plain run's step; what compares is their split.  Also printed: how many of
the proposer's forwards replayed a CUDA graph and how many ran eagerly, and the verify steps
that replayed the target's verify graph.

    PYTHONPATH=common:runtime:kernels python3 benchmarks/spec_step_profile.py \
        --model builtin:llama-3.2-1b --load-format dummy --methods ngram,draft,eagle --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import collections
import inspect
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


class PhaseTimer:
    """Wraps methods so each call is timed between two device synchronizations."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.sync()
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def copy_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` token-id prompts of ``length`` tokens: a random passage, then its start again, so
    n-gram lookup finds drafts whatever the weights (random ones included)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x = [rng.randrange(10, vocab) for _ in range(length // 2)]
        out.append((x + x)[:length])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:llama-3.2-1b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--methods", default="ngram,draft,eagle")
    p.add_argument("--draft-model", default=None, help="draft: default the target itself (every draft accepted)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    ns = p.parse_args()

    from kiln.runtime import LLM, SamplingParams

    batches = [int(b) for b in ns.batch_sizes.split(",")]
    for method in [m for m in ns.methods.split(",") if m]:
        kw = dict(model=ns.model, load_format=ns.load_format, max_num_seqs=max(max(batches), 8),
                  num_kv_blocks=2048, max_model_len=2048, speculative_method=method,
                  num_speculative_tokens=ns.num_speculative_tokens, speculative_disable_by_batch_size=max(batches))
        if method == "draft":
            kw["speculative_model"] = ns.draft_model or ns.model
        elif method == "eagle":
            from eagle_heads import write_random_head
            from kiln.runtime import loader

            src = loader.materialize_gguf(loader.resolve_source(ns.model))
            kw["speculative_model"] = str(write_random_head(tempfile.mkdtemp(prefix="eagle3-"),
                                                            loader.load_model_config(src).to_hf_dict(), "eagle3"))
        llm = LLM(**kw)
        core, runner = llm.engine.core, llm.engine.runner
        timer = PhaseTimer(runner.device)
        timer.wrap(core.spec, "plan", "plan (drafts or placeholders)")
        timer.wrap(core.scheduler, "schedule", "schedule")
        timer.wrap(core.spec, "fill", "draft (proposer)")
        timer.wrap(runner, "execute", "verify (target forward + sampler)")
        timer.wrap(core, "_process", "process outputs")
        prop = core.spec.proposer
        fwd = "_forward" if hasattr(prop, "_forward") else "_head_forward" if hasattr(prop, "_head_forward") else None
        graphs = runner.decode_graphs
        for b in batches:
            prompts = copy_prompts(llm.engine.model_config.vocab_size, b, ns.input_len, seed=b)
            sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True, detokenize=False)
            llm.generate(prompts, sp)  # warm-up
            timer.reset()
            replays0 = graphs.num_verify_replays if graphs is not None else 0
            eager = collections.Counter()
            if fwd is not None:
                inner = getattr(type(prop), fwd)

                sig = inspect.signature(inner)

                def counted(*a, _inner=inner, _sig=sig, **k):
                    q_lens = _sig.bind(prop, *a, **k).arguments["q_lens"]
                    eager["one-token" if q_lens and all(q == 1 for q in q_lens) else "catch-up"] += 1
                    return _inner(prop, *a, **k)

                setattr(prop, fwd, counted)
            graphs_d = prop.runner.decode_graphs if method == "draft" else None  # the draft's own
            catch0 = graphs_d.num_verify_replays if graphs_d is not None else 0
            head_graphs = getattr(prop, "graphs", None)  # an EAGLE head's one-token step graphs
            head0 = head_graphs.num_replays if head_graphs is not None else 0
            steps0 = llm.engine.num_steps
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            wall = time.perf_counter() - t0
            if fwd is not None:
                delattr(prop, fwd)
            steps = llm.engine.num_steps - steps0
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            st = core.spec.stats
            catch_up = (graphs_d.num_verify_replays - catch0) if graphs_d is not None else 0
            print(f"\n== {method} batch {b}: {n_out} tokens in {wall * 1e3:.0f} ms ({n_out / wall:.0f} tok/s), "
                  f"{steps} steps, acceptance {st.acceptance_rate:.3f}, verify graph replays "
                  f"{(graphs.num_verify_replays - replays0) if graphs is not None else 0}, "
                  f"draft-side graphs: {'yes' if getattr(getattr(prop, 'runner', None), 'decode_graphs', None) else 'no'}, "
                  f"proposer forwards {dict(eager)} (+{catch_up} catch-ups replayed as graphs"
                  f"{f', +{head_graphs.num_replays - head0} head steps replayed as graphs' if head_graphs else ''})")
            for name, s in sorted(timer.seconds.items(), key=lambda x: -x[1]):
                print(f"   {name:38s} {s * 1e3 / max(steps, 1):8.3f} ms/step  ({timer.calls[name]} calls)")
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
