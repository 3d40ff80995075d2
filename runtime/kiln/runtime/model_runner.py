"""Runs one scheduled step on the model: builds input ids, positions, slot mapping and
block tables from a ``SchedulerOutput``, runs the forward pass, and samples.

Input preparation is separate from running the model (nano-vllm's ``prepare_*``); the
attention metadata travels on the side so ``forward(input_ids, positions, meta)`` stays
small.  Only rows that finish their known tokens this step are projected to logits.
Decode steps replay CUDA graphs (``decode_graphs``); ``kernel_warmup`` compiles the Triton
kernel variants at start-up.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from . import kernel_warmup
from .attention import AttentionMetadata
from .config import EngineArgs
from .core.request import PLACEHOLDER_TOKEN_ID
from .core.sched_output import ScheduledRequest, SchedulerOutput
from .distributed import parallel
from .distributed.parallel import TPContext
from .decode_graphs import SLOW_GEMM_BATCH_SIZES, DecodeGraphs, decode_graph_sizes  # noqa: F401
from .model.config import ModelConfig
from .model.llama import LlamaForCausalLM
from .sampler import DeviceSample, SamplingRow, sample_on_device  # noqa: F401
from .step_result import PendingStep, StepResult  # noqa: F401

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


class ModelRunner:
    """Owns the model weights, the paged KV pool and the step loop's tensors.

    Args:
        model_config: the model's shape.
        args: engine settings (device, dtype, block size, pool sizing, kernel choices:
            ``args.kernel_options()`` goes to every layer of the model).
    """

    def __init__(self, model_config: ModelConfig, args: EngineArgs, tp: TPContext | None = None):
        self.model_config = model_config
        self.args = args
        # tensor parallelism: this process's rank (rank 0 drives ranks 1..N-1, ``distributed.parallel``)
        self.tp = tp or TPContext()
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and self.tp.enabled:
            self.device = torch.device("cuda", self.tp.rank)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.block_size = args.block_size
        torch.manual_seed(args.seed)
        if self.device.type == "cpu" and args.cpu_threads:
            torch.set_num_threads(args.cpu_threads)
        self.kernel_options = args.kernel_options()
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_config, self.tp.size, self.tp.rank,
                                          kernel_options=self.kernel_options).to(self.dtype)
        # KV heads held by this rank (all ranks replicate a head when tp exceeds the KV heads)
        self.num_kv_heads = max(1, model_config.num_key_value_heads // self.tp.size)
        self.model.eval()
        self.num_kv_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The last launched step's sampled ids (int64 [S] on the device) and the row of each
        # request in it: the next step's placeholder inputs are read from there.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self.decode_graphs: DecodeGraphs | None = None
        # The LoRA transform and its adapters (``enable_lora``); None: no LoRA.
        self.lora = None
        # Speculative decoding with EAGLE heads: called after each forward with the rows'
        # scheduled requests (model order) and the final hidden states [T, hidden].
        self.hidden_sink = None
        # A launched step whose sampler waits for its grammar bitmask (``defer_sample``) and
        # that mask: launched before the next step's forward pass (or when its result is read).
        self._deferred: tuple[PendingStep, object] | None = None

    def enable_lora(self, config) -> None:
        """Wrap the model's target linears for multi-LoRA serving (``lora.LoRAManager``),
        after the base weights are loaded (quantized or not) and before warm-up and graph
        capture (the graphs read the LoRA mapping's buffers)."""
        from .lora.manager import LoRAManager  # noqa: PLC0415

        max_tokens = max(self.args.max_num_batched_tokens or 0, self.args.max_num_seqs or 0, 1)
        self.lora = LoRAManager(self.model, self.model_config, config, max_tokens + 16)

    # -- weights -------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Load ``(hf_name, tensor)`` pairs; raises ValueError when a parameter is left unset."""
        loaded = self.model.load_weights(weights)
        missing = {n for n, _ in self.model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shape (``--load-format dummy``), scaled like a trained
        model's (normal, std 0.02; norms at 1) so activations stay in range; quantized by
        rounding to nearest when ``args.quantization`` names a method (``quantization.rtn``);
        with ``args.kv_cache_dtype`` fp8, KV scales for this init (``kv_fp8.install_dummy_scales``)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for name, p in self.model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, 0.02, generator=g)
        if self.args.quantization != "none":
            from .quantization.rtn import quantize_model_rtn  # noqa: PLC0415

            quantize_model_rtn(self.model, self.args.quantization)
        if self.args.kv_cache_dtype == "fp8":
            from .quantization import kv_fp8  # noqa: PLC0415

            kv_fp8.install_dummy_scales(self.model, self.model_config, self.device)
            self.kv_cache_torch_dtype = kv_fp8.KV_DTYPE

    # -- KV cache ------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.kv_cache_dtype()).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def kv_cache_dtype(self) -> torch.dtype:
        # An engine with an FP8 KV cache sets ``kv_cache_torch_dtype`` (engine_folder.EngineFolder.load_into).
        return getattr(self, "kv_cache_torch_dtype", None) or self.dtype

    def profile_num_kv_blocks(self) -> int:
        """Blocks that fit the configured budget: ``--num-kv-blocks`` when given; on CUDA the
        free memory up to ``kv_cache_memory_fraction`` of the total after weights and a peak
        activation estimate; on CPU ``cpu_kv_cache_bytes``."""
        if self.args.num_kv_blocks:
            return self.args.num_kv_blocks
        n = self._local_num_kv_blocks()
        if self.tp.enabled:  # every rank allocates the same pool: the smallest budget wins
            t = torch.tensor([n], dtype=torch.int64)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp.control)
            n = int(t.item())
        return n

    def _local_num_kv_blocks(self) -> int:
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
        shape = (num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
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
            gib = 2 * len(layers) * num_blocks * self.block_size * self.num_kv_heads * cfg.head_dim \
                * torch.empty((), dtype=self.kv_cache_dtype()).element_size() / 2**30
            raise ValueError(f"the KV cache of {num_blocks} blocks ({gib:.1f} GiB on {self.device.type}) does not fit "
                             f"in memory ({str(e).splitlines()[0][:200]}); lower --num-kv-blocks (or the KV "
                             "cache memory fraction)") from None
        self.num_kv_blocks = num_blocks

    # -- one step ------------------------------------------------------------------------
    def h2d(self, data, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a device tensor without a stream synchronization (through pinned
        memory on CUDA)."""
        t = torch.tensor(data, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def placeholder_source(self, request_id: str) -> int:
        try:
            return self._last_rows[request_id]
        except KeyError:
            raise RuntimeError(f"request {request_id}: an input token is a placeholder but the previous step "
                               "did not sample it (asynchronous scheduling out of order)") from None

    def fill_placeholders(self, input_ids: torch.Tensor, dst: list[int], src: list[int]) -> None:
        """``input_ids[dst] = previous step's sampled ids[src]`` on the device."""
        if dst:
            input_ids.index_copy_(0, self.h2d(dst, torch.int64),
                                  self._last_sampled.index_select(0, self.h2d(src, torch.int64)))

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
        lora_rows: list[tuple[int, int]] = []  # (lora_id, tokens) per row
        decodes = [sr for sr in out.scheduled if sr.num_new_tokens == 1]
        num_decodes = len(decodes)
        ordered = out.scheduled if num_decodes in (0, len(out.scheduled)) else \
            decodes + [sr for sr in out.scheduled if sr.num_new_tokens != 1]
        for sr in ordered:
            req = sr.request
            start, n = sr.num_computed_tokens, sr.num_new_tokens
            k = sr.num_spec_tokens  # drafts after the known tokens (speculative decoding)
            toks = req.token_slice(start, start + n - k)
            if PLACEHOLDER_TOKEN_ID in toks:
                src = self.placeholder_source(req.request_id)
                for j, t in enumerate(toks):
                    if t == PLACEHOLDER_TOKEN_ID:
                        ph_dst.append(len(input_ids) + j)
                        ph_src.append(src)
            input_ids.extend(toks)
            input_ids.extend(sr.spec_token_ids)
            positions.extend(range(start, start + n))
            blocks = sr.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            q_lens.append(n)
            tables.append(blocks)
            lora_rows.append((req.lora_id, n))
            if sr.needs_sample:  # the last known token's row, and each draft's
                logit_rows.extend(range(len(input_ids) - 1 - k, len(input_ids)))
        meta = self.attention_metadata(slots, seq_lens, q_lens, tables, num_decodes)
        if self.lora is not None:
            self.lora.set_batch(lora_rows)
        ids_t = self.h2d(input_ids, torch.int64)
        self.fill_placeholders(ids_t, ph_dst, ph_src)
        return ids_t, self.h2d(positions, torch.int64), meta, logit_rows, ordered

    def attention_metadata(self, slots: list[int], seq_lens: list[int], q_lens: list[int], tables: list[list[int]],
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
            slot_mapping=self.h2d(slots, torch.int64),
            block_tables=bt_t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else bt_t,
            seq_lens=self.h2d(seq_lens, torch.int32),
            query_start_loc=self.h2d(qsl, torch.int32),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            seq_lens_list=seq_lens,
            query_lens_list=q_lens,
            block_size=self.block_size,
            num_decodes=num_decodes if split else 0,
            prefill_query_start_loc=self.h2d([x - num_decodes for x in qsl[num_decodes:]], torch.int32)
            if split and dev.type == "cuda" else None,
            max_decode_seq_len=max(seq_lens[:num_decodes]) if split else 0,
        )

    # -- kernel warm-up and CUDA graphs ---------------------------------------------------------
    WARMUP_PREFILL_TOKENS = kernel_warmup.WARMUP_PREFILL_TOKENS
    WARMUP_LINEAR_MAX_M = kernel_warmup.WARMUP_LINEAR_MAX_M

    def warmup_kernels(self, max_tokens: int | None = None, max_model_len: int | None = None,
                       max_num_seqs: int | None = None) -> list[str]:
        """Compile the Triton kernel variants serving steps reach (CUDA only;
        ``kernel_warmup.warmup_kernels``); returns the variants compiled."""
        return kernel_warmup.warmup_kernels(self, max_tokens, max_model_len, max_num_seqs)

    def warmup_steps(self, max_tokens: int, max_model_len: int | None = None,
                     max_num_seqs: int | None = None) -> list[list[tuple[int, int]]]:
        """The warm-up's synthetic steps (``kernel_warmup.warmup_steps``)."""
        return kernel_warmup.warmup_steps(max_tokens, max_model_len, max_num_seqs)

    def _warmup_forward(self, rows: list[tuple[int, int]]) -> None:
        """One eager warm-up forward over ``(context, new_tokens)`` rows, writing nothing."""
        kernel_warmup.warmup_forward(self, rows)

    def capture_cuda_graphs(self, max_model_len: int, catch_up_rows: int = 0) -> None:
        """Capture the decode step's CUDA graphs (``decode_graphs.DecodeGraphs``) for contexts
        up to ``max_model_len`` tokens, and the verify step's with speculative decoding (or,
        for a draft model, multi-token graphs of ``catch_up_rows`` rows per sequence);
        nothing off CUDA or with ``enable_cuda_graphs`` off."""
        if self.device.type != "cuda" or not self.args.enable_cuda_graphs:
            return
        spec = self.args.speculative
        if spec is not None:
            verify_len, verify_max_seqs = spec.num_speculative_tokens + 1, spec.max_batch_size
        else:
            verify_len, verify_max_seqs = catch_up_rows, self.args.max_num_seqs if catch_up_rows else 0
        self.decode_graphs = DecodeGraphs(self, self.args.max_num_seqs, max_model_len, verify_len=verify_len,
                                          verify_max_seqs=verify_max_seqs)
        self.decode_graphs.capture()

    def execute(self, out: SchedulerOutput, rows: dict[str, SamplingRow], grammar_mask=None,
                draft_probs: dict | None = None) -> StepResult:
        """Run a step and wait for its sampled tokens (``execute_async(...).result()``)."""
        return self.execute_async(out, rows, grammar_mask, draft_probs).result()

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput, rows: dict[str, SamplingRow], grammar_mask=None,
                      draft_probs: dict | None = None, defer_sample: bool = False) -> PendingStep:
        """Launch the forward pass for a scheduled step and sample the requests that need a
        token, without waiting for the device: the sampled ids are copied to pinned host
        memory behind an event, and stay on the device as the next step's placeholder
        inputs.  A step whose sampler was deferred is launched first.

        Args:
            out: the scheduler's decision for this step.
            rows: sampling settings per request id (only those with ``needs_sample``).
            grammar_mask: structured output: called once the forward pass is launched and
                before sampling; returns the step's ``structured_output.bitmask.GrammarMask``
                (its rows possibly still being filled on the host) or None.
            draft_probs: a step verifying drafts (``out.num_spec_tokens``): per request id the
                draft model's float32 [k, V] distributions of its drafts (absent: point-mass
                drafts, e.g. n-gram); the step's result then holds token lists.
            defer_sample: a step with a grammar mask launches its sampler (which waits for the
                mask) only before the next step's forward pass or when its result is read, so
                the host fills the mask while it plans the next step (asynchronous scheduling).
        Returns:
            A :class:`PendingStep`; its ``result()`` blocks until the tokens are on the host.
        """
        t0 = time.perf_counter()
        self.launch_deferred()
        if not out.scheduled:
            return PendingStep([], None, None, t0)
        if self.tp.enabled:  # slots first, so the workers write the same adapters into the same slots
            writes = self.lora.assign_slots({sr.request.lora_id for sr in out.scheduled if sr.request.lora_id}) \
                if self.lora is not None else []
            parallel.broadcast_plan(self.tp, parallel.plan_of(out, writes))
        logits, ids = self._forward_logits(out)
        if logits is None:
            return PendingStep([], None, None, t0)
        mask = grammar_mask() if grammar_mask is not None else None
        if out.num_spec_tokens:  # a synchronous step: nothing reads its tokens on the device
            from .rejection_sampler import verify_step  # noqa: PLC0415

            self._last_sampled, self._last_rows = None, {}
            order, sample = verify_step(self, out, logits, ids, rows, draft_probs or {}, mask)
            return PendingStep(order, sample, None, t0)
        if mask is not None and defer_sample:
            step = PendingStep(ids, None, None, t0, launch=lambda: self._sample(logits, ids, rows, mask))
            self._deferred = (step, mask)
            return step
        return PendingStep(ids, *self._sample(logits, ids, rows, mask), t0)

    def launch_deferred(self, if_ready: bool = False) -> None:
        """Launch the sampler of the step whose sampling was deferred, if any; with
        ``if_ready`` only when its grammar mask is filled already (no wait)."""
        if self._deferred is not None and (not if_ready or self._deferred[1].ready):
            step, _ = self._deferred
            self._deferred = None
            step.launch()

    def _sample(self, logits: torch.Tensor, ids: list[str], rows: dict[str, SamplingRow],
                mask) -> tuple[DeviceSample, torch.cuda.Event | None]:
        """Sample a step's logits [S, V] (rows of ``ids``), with its grammar mask if any;
        returns the sample (copying to the host on CUDA) and the event after the copies."""
        bitmask = mask_rows = None
        if mask is not None:
            bitmask, mask_rows = self.mask_on_device(mask, ids)
        ds = sample_on_device(logits, [rows[i] for i in ids], bitmask, mask_rows)
        if self.tp.enabled:  # the other ranks keep the sampled ids as placeholder inputs
            torch.distributed.broadcast(ds.token_ids, src=0)
        self._last_sampled = ds.token_ids
        self._last_rows = {rid: j for j, rid in enumerate(ids)}
        event = None
        if ds.token_ids.is_cuda:
            ds = ds.start_copy()
            event = torch.cuda.Event()
            event.record()
        return ds, event

    def mask_on_device(self, mask, ids: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A ``GrammarMask`` for sampled rows ``ids``: its bitmask int32 [G, W] on the device
        (waits for the host fill) and the logits row of each of its G rows (int64 [G] on the
        device; None when they are rows 0..S-1 in order)."""
        pos = {rid: j for j, rid in enumerate(ids)}
        missing = [rid for rid in mask.request_ids if rid not in pos]
        if missing:
            raise RuntimeError(f"grammar bitmask rows {missing[:3]} are not sampled rows of this step")
        rows = [pos[rid] for rid in mask.request_ids]
        bitmask = mask.to_device(self.device)[: len(rows)]  # the rows after: draft positions
        if len(rows) == len(ids) and all(r == j for j, r in enumerate(rows)):
            return bitmask, None
        return bitmask, self.h2d(rows, torch.int64)

    def draft_mask_on_device(self, mask, ids: list[str], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``GrammarMask``'s draft-position rows for sequences ``ids`` that verify drafts,
        whose logits rows are contiguous, ``counts[i]`` (k + 1) each, in ``ids`` order: the
        bitmask rows int32 [D, W] on the device and the logits row of each (int64 [D])."""
        start, sel, rows = 0, [], []
        for rid, n in zip(ids, counts):
            first, m = mask.draft_rows.get(rid, (None, 0))
            if first is not None:
                if m != n:
                    raise RuntimeError(f"grammar bitmask of {rid!r} has {m} draft rows, the step verifies {n}")
                sel.extend(range(first, first + n))
                rows.extend(range(start, start + n))
            start += n
        bitmask = mask.to_device(self.device)
        return bitmask.index_select(0, self.h2d(sel, torch.int64)), self.h2d(rows, torch.int64)

    def _forward_logits(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[str]]:
        """The forward pass of a step (graph replay or eager) and the float32 logits [S, vocab]
        of its sampling rows with their request ids; ``(None, [])`` when no row samples."""
        hidden = self.decode_graphs.run(out) if self.decode_graphs is not None else None
        if hidden is not None:  # rows in scheduled order, each request's in turn
            ordered = out.scheduled
            logit_rows = []
            r = 0
            for sr in ordered:
                r += sr.num_new_tokens
                if sr.needs_sample:  # the last known token's row, and each draft's
                    logit_rows.extend(range(r - 1 - sr.num_spec_tokens, r))
        else:
            input_ids, positions, meta, logit_rows, ordered = self.prepare_inputs(out)
            hidden = self.model(input_ids, positions, meta)
        if self.hidden_sink is not None:  # EAGLE: the target's features of every computed row
            self.hidden_sink(ordered, hidden)
        ids = [sr.request.request_id for sr in ordered if sr.needs_sample]
        if not logit_rows:
            self._last_sampled, self._last_rows = None, {}
            return None, []
        if len(logit_rows) == hidden.shape[0]:  # every row samples (pure decode): no gather
            h = hidden
        else:
            h = hidden.index_select(0, self.h2d(logit_rows, torch.int64))
        return self.model.compute_logits(h), ids

    @torch.inference_mode()
    def execute_worker(self, out: SchedulerOutput) -> None:
        """Ranks 1..N-1: the same step as rank 0's ``execute_async`` (same collectives in the
        same order), without sampling: the sampled ids arrive by broadcast from rank 0."""
        logits, ids = self._forward_logits(out)
        if logits is None:
            return
        sampled = torch.empty(len(ids), dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(sampled, src=0)
        self._last_sampled = sampled
        self._last_rows = {rid: j for j, rid in enumerate(ids)}

    def close(self) -> None:
        """Rank 0: stop the tensor-parallel workers and leave the process group (no-op at tp 1)."""
        self.launch_deferred()  # the workers wait for its broadcast
        if self.tp.enabled and self.tp.rank == 0 and torch.distributed.is_initialized():
            parallel.shutdown(self.tp)
            torch.distributed.destroy_process_group()
            self.tp.workers = []
