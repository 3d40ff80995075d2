"""CUDA graphs of an EAGLE head's one-token steps (drafts 2..k of each proposal).

After its catch-up forward over the target's features, an EAGLE head drafts one token per
sequence at a time from its own features: a decode step of a one-layer model plus an LM head
over the whole (or the draft) vocabulary.  Run eagerly that is some forty kernel launches per
draft, which on a GPU cost more host time than the device spends on them; replayed as a graph
it is one launch (vLLM's EAGLE proposer captures the same step).

The graphs read the target's decode-graph inputs (token ids, positions, slots, context
lengths, block tables: ``DecodeGraphs.stage_rows`` stages them, the drafts read from the
device) and a persistent feature buffer of their own; the head's KV cache is written through
the same slots.  One graph per decode batch size up to the first that holds the speculation's
switch-off batch size, all in one memory pool.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)


class EagleHeadGraphs:
    """The captured one-token steps of one EAGLE head.

    Args:
        head: the :class:`~kiln.runtime.model.eagle.EagleHead` (KV cache bound).
        runner: the target's ``ModelRunner``, with decode graphs (their inputs are shared).
        max_num_seqs: most sequences that draft in one step (sequences).
    """

    def __init__(self, head, runner, max_num_seqs: int):
        self.head = head
        self.runner = runner
        self.inputs = runner.decode_graphs
        sizes = self.inputs.sizes
        top = next((b for b in sizes if b >= max_num_seqs), sizes[-1])
        self.sizes = [b for b in sizes if b <= top]
        H = head.post_attention_layernorm.weight.shape[0]
        self.features = torch.zeros(self.sizes[-1], H, dtype=runner.dtype, device=runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # per size: float32 logits [bs, target vocab], next features [bs, H]
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_replays = 0  # head steps run as a graph

    def step(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The call a graph of ``bs`` rows captures: the head over the staged inputs and
        ``features[:bs]``; returns float32 logits [bs, V] and the next features [bs, H]."""
        g, model = self.inputs, self.runner.model
        ids = g.input_ids[:bs]
        emb = self.head.embed_tokens(ids) if self.head.embed_tokens is not None else model.model.embed_tokens(ids)
        for_logits, nxt = self.head(emb, self.features[:bs], g.positions[:bs], g.metadata(bs), False)
        return self.head.compute_logits(for_logits, model.lm_head), nxt

    def capture(self) -> None:
        """Capture one graph per size, largest first (the inputs staged as idle rows: no
        K/V is written)."""
        t0 = time.perf_counter()
        g = self.inputs
        g.slots.fill_(-1)
        g.seq_lens.zero_()
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                for _ in range(2):  # compile and warm up outside the capture
                    self.step(bs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self.step(bs)
                self.graphs[bs] = graph
                pool = pool if pool is not None else graph.pool()
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs of the EAGLE head's draft steps (batch sizes %s) in %.1fs",
                 len(self.graphs), self.sizes, time.perf_counter() - t0)

    def run(self, tokens: torch.Tensor, features: torch.Tensor, positions: list[int],
            block_tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One head step over ``n`` rows: row ``i`` reads draft ``tokens[i]`` (int64 [n] on
        the device) at position ``positions[i]`` with feature ``features[i]`` ([n, H]) over
        the block ids ``block_tables[i]``.  Returns views of the graph's static outputs
        (logits [n, V], next features [n, H]), valid until the next replay; None when no
        graph holds ``n`` rows."""
        n = len(positions)
        if not n or n > self.sizes[-1]:
            return None
        bs = self.inputs.stage_rows(tokens, positions, block_tables)
        self.features[:n].copy_(features)
        self.graphs[bs].replay()
        self.num_replays += 1
        logits, nxt = self.outputs[bs]
        return logits[:n], nxt[:n]
