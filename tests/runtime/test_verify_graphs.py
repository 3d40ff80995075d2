"""CUDA graphs of the speculative verify step (``decode_graphs.DecodeGraphs.run_verify``): on
a GPU, greedy outputs with the verify step replayed as a graph equal decoding without
speculation, with a draft model that is the target itself (every draft accepted: several
tokens per step), all sequences verifying five rows or a mix of 1..5 rows in one step.  Skipped without CUDA; CI runs the CPU test of what the
graphs read instead (the staging, with the captured call made eagerly).  On the device:

    python3 -m pytest -q tests/runtime/test_verify_graphs.py
"""

from __future__ import annotations

import random

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

MODEL = dict(model="builtin:llama-3.2-1b", load_format="dummy", dtype="float32", max_num_seqs=8,
             num_kv_blocks=512, max_model_len=512, max_num_batched_tokens=256)


def _prompts(vocab: int) -> list[list[int]]:
    """Three copy prompts (a passage, then its start again: n-gram finds drafts) and three
    random ones (no drafts most steps), so verify steps mix sequences of 1..k+1 rows."""
    rng = random.Random(7)
    out = []
    for i in range(6):
        x = [rng.randrange(100, vocab) for _ in range(40 + 8 * i)]
        out.append(x + x + x[:12] if i % 2 == 0 else x)
    return out


@pytest.fixture(scope="module")
def baseline():
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(**MODEL)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    del llm
    torch.cuda.empty_cache()
    return prompts, want


def _mixed_params():
    """Per prompt: other max_tokens (sequences near their end verify fewer drafts) and, for
    one, a presence penalty (it never drafts: one row per step beside the others' five)."""
    from kiln.runtime import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False,
                           presence_penalty=0.5 if i == 2 else 0.0)
            for i, m in enumerate((24, 7, 13, 5, 18, 9))]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["draft", "draft-mixed"])
def test_verify_graph_outputs_equal_plain_decoding(baseline, case):
    """The target itself as its draft model (the same seeded random weights): every greedy
    draft is accepted, so verify steps carry five rows per sequence; ``draft-mixed`` mixes
    sequences verifying 1..5 rows in one step.  (n-gram drafts need a model that repeats its
    prompt; a random model's next token never continues a match, so n-gram would verify
    nothing here: the CPU test below covers it on the embedded default.)"""
    from kiln.runtime import LLM, SamplingParams

    prompts, want = baseline
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    if case == "draft-mixed":
        sp = _mixed_params()
        plain = LLM(**MODEL)
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
        del plain
        torch.cuda.empty_cache()
    llm = LLM(**MODEL, speculative_method="draft", num_speculative_tokens=4, speculative_model="builtin:llama-3.2-1b",
              speculative_disable_by_batch_size=8)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.verify_graphs, "no verify graphs captured"
    assert graphs.verify_len == 5
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]  # batched
    sp1 = sp[:2] if isinstance(sp, list) else sp
    got1 = [o.outputs[0].token_ids for o in (llm.generate([p], s)[0] for p, s in
                                             zip(prompts[:2], sp1 if isinstance(sp1, list) else [sp1] * 2))]
    stats = llm.engine.core.spec.stats
    assert graphs.num_verify_replays > 0
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate > 0.9, stats.acceptance_rate
    assert got == want
    assert got1 == want[:2]
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


class _EagerGraph:
    """On the CPU, where no CUDA graph can be captured: ``replay()`` makes the call a captured
    graph would replay (the model over the persistent input buffers) into its static output."""

    def __init__(self, graphs, bs: int):
        self.graphs, self.bs = graphs, bs
        rows = bs * graphs.verify_len
        self.call = lambda: graphs.runner.model(graphs.input_ids[:rows], graphs.positions[:rows],
                                                graphs.verify_metadata(bs))

    def replay(self) -> None:
        self.graphs.verify_outputs[self.bs].copy_(self.call())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in; the GPU runs the real graphs above")
def test_verify_step_staging_on_the_cpu():
    """What a verify graph reads, staged by ``run_verify`` (token rows of each sequence packed,
    query start offsets, padded rows and sequences, logits rows), gives the eager forward's
    greedy tokens: the embedded default with n-gram drafts on the copy prompts, batched and
    one by one, the verify steps all through the staged buffers."""
    from test_spec_decode import COPY_PROMPTS  # noqa: PLC0415

    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.decode_graphs import DecodeGraphs

    sp = SamplingParams(temperature=0.0, max_tokens=16)
    base = dict(num_kv_blocks=64, max_num_batched_tokens=128, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in LLM(**base).generate(COPY_PROMPTS, sp)]
    llm = LLM(speculative_method="ngram", num_speculative_tokens=4, **base)
    runner = llm.engine.runner
    g = DecodeGraphs(runner, 4, llm.engine.max_model_len, verify_len=5, verify_max_seqs=4)
    hidden = llm.engine.model_config.hidden_size
    for bs in g.verify_sizes:
        g.verify_outputs[bs] = torch.empty(bs * g.verify_len, hidden, dtype=runner.dtype)
        g.verify_graphs[bs] = _EagerGraph(g, bs)
    assert g.verify_sizes == [1, 2, 4] and not g.graphs  # decode steps stay eager
    runner.decode_graphs = g
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(COPY_PROMPTS, sp)]
        got1 = [llm.generate([p], sp)[0].outputs[0].token_ids for p in COPY_PROMPTS[:2]]
    finally:
        runner.decode_graphs = None
    assert g.num_verify_replays > 0 and llm.engine.core.spec.stats.num_accepted_tokens > 0
    assert got == want and got1 == want[:2]
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0



@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_head_graphs_propose_the_eager_drafts(baseline, kind, tmp_path):
    """A random EAGLE / EAGLE-3 head of the target's shape: with CUDA graphs its one-token
    steps replay ``EagleHeadGraphs`` (drafts read from the device, one read-back per step)
    and propose the drafts of the same engine without graphs, step by step (the target's and
    the head's forwards run other kernels there: a near-tie may flip a rare draft, so 98 % must
    agree); outputs equal plain decoding either way."""
    import sys
    from pathlib import Path

    from kiln.runtime import LLM, SamplingParams, loader

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from eagle_heads import write_random_head
    from test_spec_decode_tiny import _record_drafts

    prompts, want = baseline
    cfg = loader.load_model_config(loader.resolve_source(MODEL["model"])).to_hf_dict()
    head = str(write_random_head(tmp_path, cfg, kind))
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    drafts, outputs = [], []
    for graphs in (False, True):
        llm = LLM(**MODEL, enable_cuda_graphs=graphs, speculative_method="eagle", num_speculative_tokens=4,
                  speculative_model=head, speculative_disable_by_batch_size=8)
        prop = llm.engine.core.spec.proposer
        assert (prop.graphs is not None) == graphs
        drafts.append(_record_drafts(llm))
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
        if graphs:
            assert prop.graphs.num_replays > 0
        assert llm.engine.core.spec.stats.num_draft_tokens > 0
        assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0
        del llm, prop
        torch.cuda.empty_cache()
    assert outputs[0] == want and outputs[1] == want
    eager = [t for step in drafts[0] for d in step for t in d]
    graphed = [t for step in drafts[1] for d in step for t in d]
    assert len(eager) == len(graphed) > 0
    assert sum(a == b for a, b in zip(eager, graphed)) >= 0.98 * len(eager)
