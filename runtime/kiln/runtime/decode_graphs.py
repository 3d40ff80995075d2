"""CUDA graphs of the decode step: captured once per batch-size bucket, replayed per step.

A pure-decode step (every sequence one new token) is one graph replay instead of hundreds of
kernel launches (nano-vllm and vLLM do the same).  The graphs read persistent input buffers
(token ids, positions, slots, context lengths, block tables) that each step fills through
pinned staging memory; padded rows have ``seq_len`` 0 and slot -1.

With speculative decoding, the verify step (each sequence its last known token plus up to
``k`` drafts) has graphs of its own: ``bs * (k + 1)`` token rows for ``bs`` sequences, the
rows of each sequence packed one after the other from row 0 (``query_start_loc`` is an
input, so sequences may verify different numbers of drafts), attention through the kernel's
multi-token (prefill) path, whose launch grid depends only on the row and sequence counts.
Rows after the last sequence's are idle (slot -1, in no sequence); padded sequences have no
rows and ``seq_len`` 0.  Such graphs are captured for batch sizes up to the speculation's
switch-off size (``SpeculativeConfig.max_batch_size``), above which steps verify nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from .attention import AttentionMetadata
from .core.request import PLACEHOLDER_TOKEN_ID
from .core.sched_output import SchedulerOutput

if TYPE_CHECKING:  # pragma: no cover
    from .model_runner import ModelRunner

log = logging.getLogger(__name__)

# Decode batch sizes whose weight GEMMs cuBLAS runs badly on the H200 (bf16, Llama-3.1-8B
# shapes; benchmarks/gpu_checks.py --stage gemm): a layer's four GEMMs take 335 us at M = 400,
# 350 us at 416 and 488 us at 448 (gate_up alone 344 us), but 320 us at 480 and 512.  No
# graph is captured at these sizes: such steps pad to the next bucket.
SLOW_GEMM_BATCH_SIZES = frozenset({400, 416, 448})


def decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes (rows) of the captured decode graphs: 1, 2, 4, 8, then multiples of 16,
    without ``SLOW_GEMM_BATCH_SIZES``; the largest is at least ``max_num_seqs`` (a step of
    ``n`` sequences replays the smallest size >= n, its padded rows idle)."""
    sizes = [b for b in [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16)) if b < max_num_seqs]
    top = max_num_seqs
    while top in SLOW_GEMM_BATCH_SIZES:
        top += 16
    return [b for b in sizes if b not in SLOW_GEMM_BATCH_SIZES] + [top]


class DecodeGraphs:
    """The captured decode graphs of one model runner and their input buffers.

    Args:
        runner: the model runner (model, device, block size, placeholder inputs).
        max_num_seqs: most sequences in a step (the largest graph covers it).
        max_model_len: longest context (tokens): the block tables' width.
        verify_len: speculative decoding: most token rows per sequence in a verify step
            (``k + 1`` for ``k`` drafts); 0 captures no verify graphs.
        verify_max_seqs: most sequences in a verify step (the speculation's switch-off
            batch size, at most ``max_num_seqs``).
    """

    def __init__(self, runner: "ModelRunner", max_num_seqs: int, max_model_len: int, verify_len: int = 0,
                 verify_max_seqs: int = 0):
        self.runner = runner
        self.sizes = decode_graph_sizes(max_num_seqs)
        self.verify_len = verify_len if verify_len > 1 and verify_max_seqs > 0 else 0
        self.verify_sizes = decode_graph_sizes(min(verify_max_seqs, max_num_seqs)) if self.verify_len else []
        max_bs = max(self.sizes[-1], self.verify_sizes[-1] if self.verify_sizes else 0)
        max_rows = max(max_bs, (self.verify_sizes[-1] if self.verify_sizes else 0) * self.verify_len)
        self.block_size = runner.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        dev = runner.device
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        # The verify graphs' query start offsets (an input: rows per sequence vary by step).
        self.verify_qsl = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        # Two sets of pinned staging buffers, used in turn: with asynchronous scheduling the
        # host fills step N+1's inputs while step N's copies may still be queued.  Rows 0-2
        # are per token row (ids, positions, slots), row 3 per sequence (context lengths) and,
        # for a verify step, row 4 its query start offsets.
        pin = dev.type == "cuda"  # (the CPU only for tests of the staging: no graphs there)
        self.host = [torch.zeros(5, max_rows + 1, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host_table = [torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
                           for _ in range(2)]
        # numpy views of the staging sets: rows are written from Python lists in one
        # assignment each (element-wise tensor writes cost ~1 us apiece, ms per step at 512 rows)
        self.host_np = [t.numpy() for t in self.host]
        self.host_table_np = [t.numpy() for t in self.host_table]
        self.turn = 0
        # Per staging set, an event recorded after its copies were queued: a set is written
        # again only once they ran (a draft model's or an EAGLE head's forwards are queued
        # back to back, more than one in flight).
        self.staged = [torch.cuda.Event() for _ in range(2)] if pin else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # EAGLE-3: the residual streams the model keeps (``LlamaModel.aux_layers``), as each
        # graph's static output [bs, k * hidden]; replays refresh ``aux_hidden`` from them.
        self.aux_outputs: dict[int, torch.Tensor] = {}
        # Verify graphs by sequences: graph, hidden states [bs * verify_len, hidden], aux streams.
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_outputs: dict[int, torch.Tensor] = {}
        self.verify_aux_outputs: dict[int, torch.Tensor] = {}
        self.num_verify_replays = 0  # verify steps run as a graph (steps)

    def capture(self) -> None:
        """Capture one graph per batch size, then one verify graph per verify batch size
        (largest first, all sharing one memory pool)."""
        t0 = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                pool = self._capture_one(bs, bs, self.metadata(bs), pool, self.graphs, self.outputs,
                                         self.aux_outputs)
            for bs in reversed(self.verify_sizes):
                pool = self._capture_one(bs * self.verify_len, bs, self.verify_metadata(bs), pool,
                                         self.verify_graphs, self.verify_outputs, self.verify_aux_outputs)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (batch sizes %s%s) in %.1fs", len(self.graphs) + len(self.verify_graphs),
                 self.sizes, f"; verify steps of up to {self.verify_len} tokens per sequence at {self.verify_sizes}"
                 if self.verify_sizes else "", time.perf_counter() - t0)

    def _capture_one(self, rows: int, bs: int, meta: AttentionMetadata, pool, graphs: dict, outputs: dict,
                     aux_outputs: dict):
        """Capture the model over ``rows`` token rows of ``bs`` sequences into ``graphs[bs]``
        (its output into ``outputs[bs]``); returns the memory pool the graphs share."""
        model = self.runner.model
        if self.runner.lora is not None:  # LoRA kernels in the graph; slots are inputs
            self.runner.lora.set_batch([], num_tokens=rows, active=True)
        # Warm up (Triton compilation, cuBLAS handles) outside the capture.
        for _ in range(2):
            model(self.input_ids[:rows], self.positions[:rows], meta)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outputs[bs] = model(self.input_ids[:rows], self.positions[:rows], meta)
        if model.model.aux_layers:
            aux_outputs[bs] = model.model.aux_hidden
        graphs[bs] = g
        return pool if pool is not None else g.pool()

    def metadata(self, bs: int) -> AttentionMetadata:
        """The attention metadata over the persistent buffers, for a graph of ``bs`` rows."""
        return AttentionMetadata(
            slot_mapping=self.slots[:bs], block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
            query_start_loc=self.qsl[: bs + 1], max_query_len=1, max_seq_len=0,
            seq_lens_list=[0] * bs, query_lens_list=[1] * bs, block_size=self.block_size)

    def verify_metadata(self, bs: int) -> AttentionMetadata:
        """The attention metadata of a verify graph of ``bs`` sequences (``bs * verify_len``
        token rows; the multi-token kernel path, query start offsets from ``verify_qsl``)."""
        rows = bs * self.verify_len
        return AttentionMetadata(
            slot_mapping=self.slots[:rows], block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
            query_start_loc=self.verify_qsl[: bs + 1], max_query_len=self.verify_len, max_seq_len=0,
            seq_lens_list=[0] * bs, query_lens_list=[self.verify_len] * bs, block_size=self.block_size)

    def run(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Replay the graph for a pure-decode step: hidden states [n, hidden] of its ``n``
        sequences; for a verify step (``out.num_spec_tokens``) the verify graph's, [T, hidden]
        for its ``T`` token rows in ``out.scheduled`` order.  None when no graph fits the
        step (prefill chunks, more sequences than every graph)."""
        if out.num_spec_tokens:
            return self.run_verify(out)
        n = len(out.scheduled)
        if not self.graphs or n > self.sizes[-1] or any(sr.num_new_tokens != 1 for sr in out.scheduled):
            return None
        ph_dst: list[int] = []
        ph_src: list[int] = []
        tokens: list[int] = []
        for i, sr in enumerate(out.scheduled):
            tok = sr.request.token_at(sr.num_computed_tokens)
            if tok == PLACEHOLDER_TOKEN_ID:
                ph_dst.append(i)
                ph_src.append(self.runner.placeholder_source(sr.request.request_id))
                tok = 0
            tokens.append(tok)
        lora = [(sr.request.lora_id, 1) for sr in out.scheduled] if self.runner.lora is not None else None
        return self._replay_decode(tokens, [sr.num_computed_tokens for sr in out.scheduled],
                                   [sr.block_ids for sr in out.scheduled], ph_dst, ph_src, lora)

    def run_rows(self, tokens: list[int] | torch.Tensor, positions: list[int],
                 block_tables: list[list[int]]) -> torch.Tensor | None:
        """Replay the decode graph for ``n`` one-token rows (a draft model's steps, which
        have no ``SchedulerOutput``): row ``i`` is token ``tokens[i]`` (a host list, or int64
        [n] on the device: drafts not yet read back) at position ``positions[i]`` of the
        sequence whose block ids are ``block_tables[i]`` (context ``positions[i] + 1``
        tokens, its K/V written at that position).  Returns the hidden states [n, hidden];
        None when no graph is that large."""
        if not self.graphs or not len(positions) or len(positions) > self.sizes[-1]:
            return None
        bs = self.stage_rows(tokens, positions, block_tables)
        return self._replay(bs, len(positions))

    def stage_rows(self, tokens: list[int] | torch.Tensor, positions: list[int],
                   block_tables: list[list[int]]) -> int:
        """Stage ``n`` one-token rows (as :meth:`run_rows` takes them) into the persistent
        inputs of the smallest decode graph of at least ``n`` rows; returns that size.
        Graphs over the same inputs (an EAGLE head's) replay after it."""
        bs = self._stage_decode([0] * len(positions) if torch.is_tensor(tokens) else tokens, positions,
                                block_tables, [], [])
        if torch.is_tensor(tokens):
            self.input_ids[: len(positions)].copy_(tokens)
        return bs

    def _next_turn(self) -> int:
        """Alternate staging buffers, waiting until the chosen set's earlier copies ran."""
        turn = self.turn = 1 - self.turn
        if self.staged is not None:
            self.staged[turn].synchronize()
        return turn

    def _mark_staged(self, turn: int) -> None:
        if self.staged is not None:
            self.staged[turn].record()

    def _replay_decode(self, tokens: list[int], positions: list[int], block_tables: list[list[int]],
                       ph_dst: list[int], ph_src: list[int], lora_rows: list[tuple[int, int]] | None) -> torch.Tensor:
        """Stage ``n`` one-token rows into the graph inputs and replay the smallest decode
        graph of at least ``n`` rows; rows ``ph_dst`` take the previous step's sampled ids
        ``ph_src`` on the device.  Returns the hidden states [n, hidden]."""
        bs = self._stage_decode(tokens, positions, block_tables, ph_dst, ph_src)
        if lora_rows is not None:
            self.runner.lora.set_batch(lora_rows, num_tokens=bs, active=True)
        return self._replay(bs, len(tokens))

    def _replay(self, bs: int, n: int) -> torch.Tensor:
        self.graphs[bs].replay()
        if self.aux_outputs:
            self.runner.model.model.aux_hidden = self.aux_outputs[bs][:n]
        return self.outputs[bs][:n]

    def _stage_decode(self, tokens: list[int], positions: list[int], block_tables: list[list[int]],
                      ph_dst: list[int], ph_src: list[int]) -> int:
        """Stage one-token rows (host lists) into the decode graph inputs; returns the graph size."""
        n = len(tokens)
        bs = next(b for b in self.sizes if b >= n)
        blk = self.block_size
        turn = self._next_turn()
        host = self.host[turn]  # pinned [5, max_rows + 1] int64: ids, positions, slots, seq_lens
        table = self.host_table[turn]  # pinned [max_bs, max_blocks] int32
        h_ids, h_pos, h_slot, h_len = host[0], host[1], host[2], host[3]
        hnp = self.host_np[turn]
        tnp = self.host_table_np[turn]
        hnp[0, :n] = tokens
        hnp[1, :n] = positions
        hnp[2, :n] = [b[p // blk] * blk + p % blk for p, b in zip(positions, block_tables)]
        hnp[3, :n] = hnp[1, :n] + 1
        for i, b in enumerate(block_tables):
            tnp[i, : len(b)] = b
        if bs > n:
            host[:3, n:bs] = 0
            h_slot[n:bs] = -1
            h_len[n:bs] = 0
        self.input_ids[:bs].copy_(h_ids[:bs], non_blocking=True)
        self.positions[:bs].copy_(h_pos[:bs], non_blocking=True)
        self.slots[:bs].copy_(h_slot[:bs], non_blocking=True)
        self.seq_lens[:bs].copy_(h_len[:bs], non_blocking=True)
        self.block_tables[:bs].copy_(table[:bs], non_blocking=True)
        self._mark_staged(turn)
        self.runner.fill_placeholders(self.input_ids, ph_dst, ph_src)
        return bs

    def run_verify(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Replay the verify graph for a step whose every sequence computes at most
        ``verify_len`` tokens (its known ones, then its drafts): hidden states [T, hidden] of
        the step's ``T`` token rows, each sequence's rows in turn in ``out.scheduled`` order
        (as the eager forward would give them without reordering); None when no verify graph
        fits."""
        if not self._verify_fits([sr.num_new_tokens for sr in out.scheduled]):
            return None
        seqs, ph_dst, ph_src = [], [], []
        r = 0
        for sr in out.scheduled:
            req = sr.request
            start, m, k = sr.num_computed_tokens, sr.num_new_tokens, sr.num_spec_tokens
            toks = req.token_slice(start, start + m - k) + list(sr.spec_token_ids)
            for j, tok in enumerate(toks):
                if tok == PLACEHOLDER_TOKEN_ID:
                    ph_dst.append(r + j)
                    ph_src.append(self.runner.placeholder_source(req.request_id))
                    toks[j] = 0
            seqs.append((toks, start, sr.block_ids, req.lora_id))
            r += m
        return self._replay_verify(seqs, ph_dst, ph_src)

    def run_verify_rows(self, tokens: list[list[int]], starts: list[int],
                        block_tables: list[list[int]]) -> torch.Tensor | None:
        """Replay a verify graph for sequences given as host lists (a draft model catching up
        on the tokens verified since its last step, which has no ``SchedulerOutput``):
        sequence ``i`` computes ``tokens[i]`` at positions ``starts[i]...`` over the block ids
        ``block_tables[i]`` (its K/V written there).  Returns the hidden states [T, hidden] of
        all rows, sequence by sequence; None when no verify graph fits."""
        if not tokens or not self._verify_fits([len(t) for t in tokens]):
            return None
        return self._replay_verify([(list(t), s, b, 0) for t, s, b in zip(tokens, starts, block_tables)], [], [])

    def _verify_fits(self, rows_per_seq: list[int]) -> bool:
        return bool(self.verify_graphs) and len(rows_per_seq) <= self.verify_sizes[-1] \
            and max(rows_per_seq, default=0) <= self.verify_len

    def _replay_verify(self, seqs: list[tuple[list[int], int, list[int], int]], ph_dst: list[int],
                       ph_src: list[int]) -> torch.Tensor:
        """Stage ``(tokens, first position, block ids, LoRA id)`` per sequence into the verify
        graph inputs (rows packed sequence by sequence, query start offsets, padded rows and
        sequences) and replay the smallest verify graph of at least as many sequences; rows
        ``ph_dst`` take the previous step's sampled ids ``ph_src`` on the device."""
        n = len(seqs)
        bs = next(b for b in self.verify_sizes if b >= n)
        rows = bs * self.verify_len
        blk = self.block_size
        turn = self._next_turn()
        host = self.host[turn]  # pinned [5, max_rows + 1] int64
        table = self.host_table[turn]
        h_ids, h_pos, h_slot, h_len, h_qsl = host[0], host[1], host[2], host[3], host[4]
        tnp = self.host_table_np[turn]
        lora_rows: list[tuple[int, int]] = []
        r = 0
        h_qsl[0] = 0
        for i, (toks, start, b, lora_id) in enumerate(seqs):
            for j, tok in enumerate(toks):
                p = start + j
                h_ids[r + j] = tok
                h_pos[r + j] = p
                h_slot[r + j] = b[p // blk] * blk + p % blk
            m = len(toks)
            r += m
            h_len[i] = start + m
            h_qsl[i + 1] = r
            tnp[i, : len(b)] = b
            lora_rows.append((lora_id, m))
        host[:2, r:rows] = 0
        h_slot[r:rows] = -1
        h_len[n:bs] = 0
        h_qsl[n + 1: bs + 1] = r  # padded sequences: no rows
        self.input_ids[:rows].copy_(h_ids[:rows], non_blocking=True)
        self.positions[:rows].copy_(h_pos[:rows], non_blocking=True)
        self.slots[:rows].copy_(h_slot[:rows], non_blocking=True)
        self.seq_lens[:bs].copy_(h_len[:bs], non_blocking=True)
        self.verify_qsl[: bs + 1].copy_(h_qsl[: bs + 1], non_blocking=True)
        self.block_tables[:bs].copy_(table[:bs], non_blocking=True)
        self._mark_staged(turn)
        self.runner.fill_placeholders(self.input_ids, ph_dst, ph_src)
        if self.runner.lora is not None:
            self.runner.lora.set_batch(lora_rows, num_tokens=rows, active=True)
        self.verify_graphs[bs].replay()
        self.num_verify_replays += 1
        if self.verify_aux_outputs:
            self.runner.model.model.aux_hidden = self.verify_aux_outputs[bs][:r]
        return self.verify_outputs[bs][:r]
