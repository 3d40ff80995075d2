"""CUDA graphs of the decode step: captured once per batch-size bucket, replayed per step.

A pure-decode step (every sequence one new token) is one graph replay instead of hundreds of
kernel launches (nano-vllm and vLLM do the same).  The graphs read persistent input buffers
(token ids, positions, slots, context lengths, block tables) that each step fills through
pinned staging memory; padded rows have ``seq_len`` 0 and slot -1.
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
    """

    def __init__(self, runner: "ModelRunner", max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.sizes = decode_graph_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        self.block_size = runner.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        dev = runner.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        # Two sets of pinned staging buffers, used in turn: with asynchronous scheduling the
        # host fills step N+1's inputs while step N's copies may still be queued.
        self.host = [torch.zeros(4, max_bs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host_table = [torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, pin_memory=True)
                           for _ in range(2)]
        self.host_table_np = [t.numpy() for t in self.host_table]
        self.turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # EAGLE-3: the residual streams the model keeps (``LlamaModel.aux_layers``), as each
        # graph's static output [bs, k * hidden]; replays refresh ``aux_hidden`` from them.
        self.aux_outputs: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        """Capture one graph per batch size (largest first, sharing one memory pool)."""
        model = self.runner.model
        pool = None
        t0 = time.perf_counter()
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                meta = self.metadata(bs)
                if self.runner.lora is not None:  # LoRA kernels in the graph; slots are inputs
                    self.runner.lora.set_batch([], num_tokens=bs, active=True)
                # Warm up (Triton compilation, cuBLAS handles) outside the capture.
                for _ in range(2):
                    model(self.input_ids[:bs], self.positions[:bs], meta)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[bs] = model(self.input_ids[:bs], self.positions[:bs], meta)
                if model.model.aux_layers:
                    self.aux_outputs[bs] = model.model.aux_hidden
                if pool is None:
                    pool = g.pool()
                self.graphs[bs] = g
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (batch sizes %s) in %.1fs", len(self.graphs), self.sizes,
                 time.perf_counter() - t0)

    def metadata(self, bs: int) -> AttentionMetadata:
        """The attention metadata over the persistent buffers, for a graph of ``bs`` rows."""
        return AttentionMetadata(
            slot_mapping=self.slots[:bs], block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
            query_start_loc=self.qsl[: bs + 1], max_query_len=1, max_seq_len=0,
            seq_lens_list=[0] * bs, query_lens_list=[1] * bs, block_size=self.block_size)

    def run(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Replay the graph for a pure-decode step: hidden states [n, hidden] of its ``n``
        sequences; None when the step is not pure decode or larger than every graph."""
        n = len(out.scheduled)
        if not self.graphs or n > self.sizes[-1] or any(sr.num_new_tokens != 1 for sr in out.scheduled):
            return None
        bs = next(b for b in self.sizes if b >= n)
        blk = self.block_size
        # Alternate staging buffers: at most one step is in flight, so the other set's
        # copies (two graph steps ago) are complete.
        turn = self.turn = 1 - self.turn
        host = self.host[turn]  # pinned [4, max_bs] int64: ids, positions, slots, seq_lens
        table = self.host_table[turn]  # pinned [max_bs, max_blocks] int32
        h_ids, h_pos, h_slot, h_len = host[0], host[1], host[2], host[3]
        tnp = self.host_table_np[turn]
        ph_dst: list[int] = []
        ph_src: list[int] = []
        for i, sr in enumerate(out.scheduled):
            p = sr.num_computed_tokens
            b = sr.block_ids
            tok = sr.request.token_at(p)
            if tok == PLACEHOLDER_TOKEN_ID:
                ph_dst.append(i)
                ph_src.append(self.runner.placeholder_source(sr.request.request_id))
                tok = 0
            h_ids[i] = tok
            h_pos[i] = p
            h_slot[i] = b[p // blk] * blk + p % blk
            h_len[i] = p + 1
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
        self.runner.fill_placeholders(self.input_ids, ph_dst, ph_src)
        if self.runner.lora is not None:
            self.runner.lora.set_batch([(sr.request.lora_id, 1) for sr in out.scheduled], num_tokens=bs, active=True)
        self.graphs[bs].replay()
        if self.aux_outputs:
            self.runner.model.model.aux_hidden = self.aux_outputs[bs][:n]
        return self.outputs[bs][:n]
