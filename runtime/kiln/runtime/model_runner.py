"""Runs one scheduled step on the model: builds input ids, positions, slot mapping and
block tables from a ``SchedulerOutput``, runs the forward pass, and samples.

Input preparation is separate from running the model (nano-vllm's ``prepare_*``); the
attention metadata travels on the side so ``forward(input_ids, positions, meta)`` stays
small.  Only rows that finish their known tokens this step are projected to logits.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionMetadata
from .config import EngineArgs
from .core.request import PLACEHOLDER_TOKEN_ID
from .core.sched_output import ScheduledRequest, SchedulerOutput
from .model.config import ModelConfig
from .model.llama import LlamaForCausalLM
from .sampler import DeviceSample, SamplingRow, sample_on_device

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# Decode batch sizes whose weight GEMMs cuBLAS runs badly on the H200 (bf16, Llama-3.1-8B
# shapes; tests/gpu/gpu_checks.py --stage gemm, 2026-12-01): a layer's four GEMMs take
# 335 us at M = 400, 350 us at 416 and 488 us at 448 (gate_up alone 344 us), but 320 us at
# 480 and 512.  No graph is captured at these sizes: such steps pad to the next bucket.
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


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU.  Raises ValueError for cuda without a GPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on CPU (CPU bf16 matmuls are slow and the
    float32 path matches transformers' float32 reference token for token)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


@dataclass
class StepResult:
    """Output of one step: sampled tokens (and logprobs) keyed by request id;
    ``forward_seconds`` is host time from launch until the result was read (seconds)."""

    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    forward_seconds: float


class PendingStep:
    """A launched step whose sampled ids are on their way to the host.

    ``result()`` waits for the device (a CUDA event recorded after the device -> pinned host
    copies) and returns the :class:`StepResult`; later calls return the same object.
    """

    def __init__(self, request_ids: list[str], sample: DeviceSample | None, event, t0: float):
        self._ids = request_ids
        self._sample = sample
        self._event = event
        self._t0 = t0
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            sampled: dict[str, int] = {}
            lps: dict[str, tuple[float, list[tuple[int, float]]]] = {}
            if self._sample is not None:
                if self._event is not None:
                    self._event.synchronize()
                res = self._sample.materialize()
                for rid, tok, lp in zip(self._ids, res.token_ids, res.logprobs):
                    sampled[rid] = tok
                    if lp is not None:
                        lps[rid] = lp
            self._result = StepResult(sampled, lps, time.perf_counter() - self._t0)
            self._sample = None
        return self._result


class ModelRunner:
    """Owns the model weights, the paged KV pool and the step loop's tensors.

    Args:
        model_config: the model's shape.
        args: engine settings (device, dtype, block size, pool sizing).
    """

    def __init__(self, model_config: ModelConfig, args: EngineArgs):
        self.model_config = model_config
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.block_size = args.block_size
        torch.manual_seed(args.seed)
        threads = args.cpu_threads or int(os.environ.get("KILN_CPU_THREADS", "0") or 0)
        if self.device.type == "cpu" and threads:
            torch.set_num_threads(threads)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_config).to(self.dtype)
        self.model.eval()
        self.num_kv_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The last launched step's sampled ids (int64 [S] on the device) and the row of each
        # request in it: the next step's placeholder inputs are read from there.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

    # -- weights -------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Load ``(hf_name, tensor)`` pairs; raises ValueError when a parameter is left unset."""
        loaded = self.model.load_weights(weights)
        missing = {n for n, _ in self.model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shape (``--load-format dummy``), scaled like a trained
        model's (normal, std 0.02; norms at 1) so activations stay in range."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for name, p in self.model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, 0.02, generator=g)

    # -- KV cache ------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.kv_cache_dtype()).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def kv_cache_dtype(self) -> torch.dtype:
        # An engine with an FP8 KV cache sets ``kv_cache_torch_dtype`` (engine_folder.EngineFolder.load_into).
        return getattr(self, "kv_cache_torch_dtype", None) or self.dtype

    def profile_num_kv_blocks(self) -> int:
        """Blocks that fit the configured budget: ``--num-kv-blocks`` when given; on CUDA the
        free memory up to ``kv_cache_memory_fraction`` of the total after weights and a peak
        activation estimate; on CPU ``cpu_kv_cache_bytes``."""
        if self.args.num_kv_blocks:
            return self.args.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            cfg = self.model_config
            # Peak activations of a full token-budget step (logits rows are few).
            act = self.args.max_num_batched_tokens * (4 * cfg.hidden_size + 2 * cfg.intermediate_size
                                                      + cfg.q_size + 2 * cfg.kv_size) * 4
            budget = total * self.args.kv_cache_memory_fraction - used - act - (1 << 30)
            return max(1, int(budget // per_block))
        return max(1, self.args.cpu_kv_cache_bytes // per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate one K and one V pool per layer: [num_blocks, block_size, Hkv, D].

        Raises:
            ValueError: the pools do not fit in the device's (or the host's) memory; the
                message gives their size in GiB and the flag to lower.
        """
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = []
        layers = list(self.model.attention_layers())
        try:
            for attn in layers:
                k = torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device)
                v = torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device)
                attn.k_cache, attn.v_cache = k, v
                self.kv_caches.append((k, v))
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            self.kv_caches = []
            for attn in layers:
                attn.k_cache = attn.v_cache = None
            gib = 2 * len(layers) * num_blocks * self.block_size * cfg.num_key_value_heads * cfg.head_dim \
                * torch.empty((), dtype=self.kv_cache_dtype()).element_size() / 2**30
            raise ValueError(f"the KV cache of {num_blocks} blocks ({gib:.1f} GiB on {self.device.type}) does not fit "
                             f"in memory ({str(e).splitlines()[0][:200]}); lower --num-kv-blocks (or the KV "
                             "cache memory fraction)") from None
        self.num_kv_blocks = num_blocks

    # -- one step ------------------------------------------------------------------------
    def _h2d(self, data, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a device tensor without a stream synchronization (through pinned
        memory on CUDA)."""
        t = torch.tensor(data, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _placeholder_source(self, request_id: str) -> int:
        try:
            return self._last_rows[request_id]
        except KeyError:
            raise RuntimeError(f"request {request_id}: an input token is a placeholder but the previous step "
                               "did not sample it (asynchronous scheduling out of order)") from None

    def _fill_placeholders(self, input_ids: torch.Tensor, dst: list[int], src: list[int]) -> None:
        """``input_ids[dst] = previous step's sampled ids[src]`` on the device."""
        if dst:
            input_ids.index_copy_(0, self._h2d(dst, torch.int64),
                                  self._last_sampled.index_select(0, self._h2d(src, torch.int64)))

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                                           list[ScheduledRequest]]:
        """Flatten the scheduled requests into model inputs.

        Input tokens that are placeholders (asynchronous scheduling: sampled by the step
        still in flight) are read from that step's sampled ids on the device.

        Decode rows (one new token) are placed first so attention can run them through the
        decode kernel and the rest through the prefill kernel.

        Returns:
            input_ids int64 [T], positions int64 [T], attention metadata, the row indices
            (into [T]) whose hidden states are projected to logits (the last new token of
            each request that samples this step), and the scheduled requests in row order.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        q_lens: list[int] = []
        logit_rows: list[int] = []
        tables: list[list[int]] = []
        ph_dst: list[int] = []
        ph_src: list[int] = []
        decodes = [sr for sr in out.scheduled if sr.num_new_tokens == 1]
        num_decodes = len(decodes)
        ordered = out.scheduled if num_decodes in (0, len(out.scheduled)) else \
            decodes + [sr for sr in out.scheduled if sr.num_new_tokens != 1]
        for sr in ordered:
            req = sr.request
            start, n = sr.num_computed_tokens, sr.num_new_tokens
            toks = req.token_slice(start, start + n)
            if PLACEHOLDER_TOKEN_ID in toks:
                src = self._placeholder_source(req.request_id)
                for j, t in enumerate(toks):
                    if t == PLACEHOLDER_TOKEN_ID:
                        ph_dst.append(len(input_ids) + j)
                        ph_src.append(src)
            input_ids.extend(toks)
            positions.extend(range(start, start + n))
            blocks = sr.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            q_lens.append(n)
            tables.append(blocks)
            if sr.needs_sample:
                logit_rows.append(len(input_ids) - 1)
        meta = self._attention_metadata(slots, seq_lens, q_lens, tables, num_decodes)
        ids_t = self._h2d(input_ids, torch.int64)
        self._fill_placeholders(ids_t, ph_dst, ph_src)
        return ids_t, self._h2d(positions, torch.int64), meta, logit_rows, ordered

    def _attention_metadata(self, slots: list[int], seq_lens: list[int], q_lens: list[int], tables: list[list[int]],
                            num_decodes: int) -> AttentionMetadata:
        """Attention metadata of a step from host lists, rows in model order (decodes first):
        ``slots`` per new token (-1: not written), context length incl. the new tokens and new
        tokens per sequence, block ids per sequence; ``num_decodes`` leading one-token rows."""
        # Columns padded to a multiple of 16: the row stride is then always divisible by 16, one
        # Triton specialization for every step (Triton specializes integer arguments that are 1
        # or divisible by 16, so a stride of 1 or 37 would compile new attention variants).
        max_blocks = -(-max(len(t) for t in tables) // 16) * 16
        bt = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        bt_t = torch.from_numpy(bt)
        split = 0 < num_decodes < len(q_lens)
        return AttentionMetadata(
            slot_mapping=self._h2d(slots, torch.int64),
            block_tables=bt_t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else bt_t,
            seq_lens=self._h2d(seq_lens, torch.int32),
            query_start_loc=self._h2d(qsl, torch.int32),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            seq_lens_list=seq_lens,
            query_lens_list=q_lens,
            block_size=self.block_size,
            num_decodes=num_decodes if split else 0,
            prefill_query_start_loc=self._h2d([x - num_decodes for x in qsl[num_decodes:]], torch.int32)
            if split and dev.type == "cuda" else None,
            max_decode_seq_len=max(seq_lens[:num_decodes]) if split else 0,
        )

    # -- kernel warm-up -----------------------------------------------------------------------
    # Token counts of the eager warm-up forwards: each side of the integer specializations
    # Triton makes (== 1, % 16 == 0) and of the launch buckets (``w4a16.m_bucket``: 2, 4, 8, 16,
    # the 64-row GEMV / tensor-core limits).
    WARMUP_PREFILL_TOKENS = (2, 3, 5, 9, 16, 17, 31, 32, 33, 64, 65, 129)
    # Linear layers run alone at every M up to this (the small-M kernels are chosen per M).
    WARMUP_LINEAR_MAX_M = 64

    @torch.inference_mode()
    def warmup_kernels(self, max_tokens: int | None = None, max_model_len: int | None = None,
                       max_num_seqs: int | None = None) -> list[str]:
        """Compile the Triton kernel variants that serving steps reach, before the first request.

        Triton compiles a kernel on its first launch per specialization (the launch config a
        launcher picks per M, dtypes, integer arguments equal to 1 or divisible by 16): 0.3 s
        (on-disk cache hit) to several seconds each, which the request that first needs it would
        pay in its step (measured: 1.9 s inside the first int4 prefill after CUDA-graph capture,
        Llama-3.1-8B shape, H200, docs/benchmarks.md, session 9).  vLLM and SGLang run
        dummy forwards at start-up for the same reason.  CUDA only; runs:

        * every distinct linear layer (same class, quantization, weight shapes, dtypes and
          strides) alone at M = 1 .. ``WARMUP_LINEAR_MAX_M`` and at M = 65 and ``max_tokens``;
          the LM head at M = 1 .. 9;
        * eager forwards (``warmup_steps``) of one prefill of T tokens
          (``WARMUP_PREFILL_TOKENS``), a prefill after a cached prefix, several prefills, and
          decodes alone and mixed with prefills over a ladder of contexts, with every slot -1:
          nothing is written to the KV cache, no block is taken.

        Args:
            max_tokens: the step token budget (``max_num_batched_tokens``); default 2048.
            max_model_len: longest context of a synthetic sequence (tokens); default no limit.
            max_num_seqs: most sequences in a synthetic step (steps with more cannot happen
                while serving, so their kernel variants are not compiled); default no limit.
        Returns:
            The kernel variants compiled (``"module:name"`` per compile).
        """
        if self.device.type != "cuda":
            return []
        from kiln.kernels.launch import record_compiles  # noqa: PLC0415

        from .model.layers import LinearBase  # noqa: PLC0415

        t0 = time.perf_counter()
        max_tokens = max(1, max_tokens or 2048)
        dev, dt = self.device, self.dtype
        with record_compiles() as compiled:
            seen = set()
            for mod in self.model.modules():
                if not isinstance(mod, LinearBase):
                    continue
                key = (type(mod).__name__, type(mod.quant_method).__name__,
                       tuple((n, tuple(t.shape), t.dtype, t.stride()) for n, t in
                             list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
                             if t is not None))
                if key in seen:
                    continue
                seen.add(key)
                for m in sorted({*range(1, self.WARMUP_LINEAR_MAX_M + 1), 65, max_tokens}):
                    mod(torch.zeros(m, mod.in_features, device=dev, dtype=dt))
            hidden = self.model_config.hidden_size
            for m in range(1, 10):
                self.model.compute_logits(torch.zeros(m, hidden, device=dev, dtype=dt))
            for rows in self.warmup_steps(max_tokens, max_model_len, max_num_seqs):
                self._warmup_forward(rows)
        torch.cuda.synchronize()
        log.info("kernel warm-up: %d Triton kernel variants compiled (or loaded from the disk cache) in %.1fs",
                 len(compiled), time.perf_counter() - t0)
        return list(compiled)

    def warmup_steps(self, max_tokens: int, max_model_len: int | None = None,
                     max_num_seqs: int | None = None) -> list[list[tuple[int, int]]]:
        """The synthetic steps of the warm-up: per step, ``(context before the step, new
        tokens)`` per sequence, decodes first, at most ``max_tokens`` new tokens,
        ``max_model_len`` context (tokens) and ``max_num_seqs`` sequences."""
        steps = [[(0, t)] for t in self.WARMUP_PREFILL_TOKENS]
        steps += [[(16, 17)], [(33, 16)], [(0, 17), (0, 16)], [(20, 1), (7, 9)]]
        # Decode contexts that reach each flash-decoding split count (``decode_num_splits``:
        # powers of two up to 32, at least 128 tokens per split), decodes alone (eager: no
        # graph for that batch) and mixed with prefills, 1, 2, 3, 16 and 17 sequences.
        for c in (100, 200, 300, 600, 1100, 2100, 4200, 8300):
            steps += [[(c, 1)], [(c, 1), (c // 2, 1)], [(c, 1)] * 3, [(c, 1)] * 16, [(c, 1)] * 17,
                      [(c, 1), (0, 17)], [(c, 1), (c // 2, 1), (0, 16)]]
        return [rows for rows in steps if sum(q for _, q in rows) <= max_tokens
                and (max_model_len is None or max(c + q for c, q in rows) <= max_model_len)
                and (max_num_seqs is None or len(rows) <= max_num_seqs)]

    def _warmup_forward(self, rows: list[tuple[int, int]]) -> None:
        """One eager forward (and LM head) over synthetic sequences ``(context, new_tokens)``
        with all slots -1 (no KV-cache writes); block tables point at blocks 0.. (read only)."""
        bs, nb = self.block_size, max(1, self.num_kv_blocks)
        seq_lens = [c + q for c, q in rows]
        q_lens = [q for _, q in rows]
        tables = [[b % nb for b in range(-(-n // bs))] for n in seq_lens]
        positions = [p for c, q in rows for p in range(c, c + q)]
        T = len(positions)
        num_decodes = 0
        while num_decodes < len(rows) and q_lens[num_decodes] == 1:
            num_decodes += 1
        meta = self._attention_metadata([-1] * T, seq_lens, q_lens, tables, num_decodes)
        ids = torch.zeros(T, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, self._h2d(positions, torch.int64), meta)
        self.model.compute_logits(hidden[torch.tensor(list(itertools.accumulate(q_lens)), device=self.device) - 1])

    # -- CUDA graphs for decode ---------------------------------------------------------------
    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """Capture the forward pass of pure-decode batches for batch-size buckets
        (``decode_graph_sizes``) over persistent input buffers, so a decode step is one graph
        replay instead of hundreds of launches (nano-vllm / vLLM do the same).  Padded rows
        have ``seq_len`` 0 and slot -1."""
        if self.device.type != "cuda" or not self.args.enable_cuda_graphs:
            return
        self.graph_bs = decode_graph_sizes(self.args.max_num_seqs)
        max_bs = self.graph_bs[-1]
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        dev = self.device
        self.g_input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.g_positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.g_slots = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.g_block_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.g_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.g_qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        # Two sets of pinned staging buffers, used in turn: with asynchronous scheduling the
        # host fills step N+1's inputs while step N's copies may still be queued.
        self.g_host = [torch.zeros(4, max_bs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.g_host_table = [torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, pin_memory=True)
                             for _ in range(2)]
        self.g_host_table_np = [t.numpy() for t in self.g_host_table]
        self.g_turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.g_outputs: dict[int, torch.Tensor] = {}
        pool = None
        t0 = time.perf_counter()
        with torch.inference_mode():
            for bs in reversed(self.graph_bs):
                meta = self._graph_meta(bs)
                # Warm up (Triton compilation, cuBLAS handles) outside the capture.
                for _ in range(2):
                    self.model(self.g_input_ids[:bs], self.g_positions[:bs], meta)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.g_outputs[bs] = self.model(self.g_input_ids[:bs], self.g_positions[:bs], meta)
                if pool is None:
                    pool = g.pool()
                self.graphs[bs] = g
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (batch sizes %s) in %.1fs", len(self.graphs), self.graph_bs,
                 time.perf_counter() - t0)

    def _graph_meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.g_slots[:bs], block_tables=self.g_block_tables[:bs], seq_lens=self.g_seq_lens[:bs],
            query_start_loc=self.g_qsl[: bs + 1], max_query_len=1, max_seq_len=0,
            seq_lens_list=[0] * bs, query_lens_list=[1] * bs, block_size=self.block_size)

    def _run_decode_graph(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Replay the captured graph for a pure-decode step; None when not applicable."""
        graphs = getattr(self, "graphs", None)
        n = len(out.scheduled)
        if not graphs or n > self.graph_bs[-1] or any(sr.num_new_tokens != 1 for sr in out.scheduled):
            return None
        bs = next(b for b in self.graph_bs if b >= n)
        blk = self.block_size
        # Alternate staging buffers: at most one step is in flight, so the other set's
        # copies (two graph steps ago) are complete.
        turn = self.g_turn = 1 - self.g_turn
        host = self.g_host[turn]  # pinned [4, max_bs] int64: ids, positions, slots, seq_lens
        table = self.g_host_table[turn]  # pinned [max_bs, max_blocks] int32
        h_ids, h_pos, h_slot, h_len = host[0], host[1], host[2], host[3]
        tnp = self.g_host_table_np[turn]
        ph_dst: list[int] = []
        ph_src: list[int] = []
        for i, sr in enumerate(out.scheduled):
            p = sr.num_computed_tokens
            b = sr.block_ids
            tok = sr.request.token_at(p)
            if tok == PLACEHOLDER_TOKEN_ID:
                ph_dst.append(i)
                ph_src.append(self._placeholder_source(sr.request.request_id))
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
        self.g_input_ids[:bs].copy_(h_ids[:bs], non_blocking=True)
        self.g_positions[:bs].copy_(h_pos[:bs], non_blocking=True)
        self.g_slots[:bs].copy_(h_slot[:bs], non_blocking=True)
        self.g_seq_lens[:bs].copy_(h_len[:bs], non_blocking=True)
        self.g_block_tables[:bs].copy_(table[:bs], non_blocking=True)
        self._fill_placeholders(self.g_input_ids, ph_dst, ph_src)
        self.graphs[bs].replay()
        return self.g_outputs[bs][:n]

    def execute(self, out: SchedulerOutput, rows: dict[str, SamplingRow]) -> StepResult:
        """Run a step and wait for its sampled tokens (``execute_async(...).result()``)."""
        return self.execute_async(out, rows).result()

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput, rows: dict[str, SamplingRow]) -> PendingStep:
        """Launch the forward pass for a scheduled step and sample the requests that need a
        token, without waiting for the device: the sampled ids are copied to pinned host
        memory behind an event, and stay on the device as the next step's placeholder
        inputs.

        Args:
            out: the scheduler's decision for this step.
            rows: sampling settings per request id (only those with ``needs_sample``).
        Returns:
            A :class:`PendingStep`; its ``result()`` blocks until the tokens are on the host.
        """
        t0 = time.perf_counter()
        if not out.scheduled:
            return PendingStep([], None, None, t0)
        hidden = self._run_decode_graph(out)
        if hidden is not None:
            ordered = out.scheduled
            logit_rows = [i for i, sr in enumerate(ordered) if sr.needs_sample]
        else:
            input_ids, positions, meta, logit_rows, ordered = self.prepare_inputs(out)
            hidden = self.model(input_ids, positions, meta)
        ids = [sr.request.request_id for sr in ordered if sr.needs_sample]
        if not logit_rows:
            self._last_sampled, self._last_rows = None, {}
            return PendingStep([], None, None, t0)
        if len(logit_rows) == hidden.shape[0]:  # every row samples (pure decode): no gather
            h = hidden
        else:
            h = hidden.index_select(0, self._h2d(logit_rows, torch.int64))
        ds = sample_on_device(self.model.compute_logits(h), [rows[i] for i in ids])
        self._last_sampled = ds.token_ids
        self._last_rows = {rid: j for j, rid in enumerate(ids)}
        event = None
        if ds.token_ids.is_cuda:
            ds = ds.start_copy()
            event = torch.cuda.Event()
            event.record()
        return PendingStep(ids, ds, event, t0)
