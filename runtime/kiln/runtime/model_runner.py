"""Runs one scheduled step on the model: builds input ids, positions, slot mapping and
block tables from a ``SchedulerOutput``, runs the forward pass, and samples.

Input preparation is separate from running the model (nano-vllm's ``prepare_*``); the
attention metadata travels on the side so ``forward(input_ids, positions, meta)`` stays
small.  Only rows that finish their known tokens this step are projected to logits.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .config import EngineArgs
from .core.sched_output import SchedulerOutput
from .model.config import ModelConfig
from .model.llama import LlamaForCausalLM
from .sampler import SamplerOutput, SamplingRow, sample

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


@dataclass
class StepResult:
    """Output of one step: sampled tokens (and logprobs) keyed by request id."""

    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    forward_seconds: float


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
        g = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.data.fill_(1.0)
            else:
                p.data.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))

    # -- KV cache ------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.kv_cache_dtype()).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def kv_cache_dtype(self) -> torch.dtype:
        # An engine with an FP8 KV cache sets ``kv_cache_torch_dtype`` (engine_format.load_into).
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
        """Allocate one K and one V pool per layer: [num_blocks, block_size, Hkv, D]."""
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = []
        for attn in self.model.attention_layers():
            k = torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device)
            v = torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device)
            attn.k_cache, attn.v_cache = k, v
            self.kv_caches.append((k, v))
        self.num_kv_blocks = num_blocks

    # -- one step ------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled requests into model inputs.

        Returns:
            input_ids int64 [T], positions int64 [T], attention metadata, and the row
            indices (into [T]) whose hidden states are projected to logits (the last new
            token of each request that samples this step).
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        q_lens: list[int] = []
        logit_rows: list[int] = []
        tables: list[list[int]] = []
        for sr in out.scheduled:
            req = sr.request
            start, n = sr.num_computed_tokens, sr.num_new_tokens
            toks = req.all_token_ids[start : start + n]
            input_ids.extend(toks)
            positions.extend(range(start, start + n))
            blocks = sr.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            q_lens.append(n)
            tables.append(blocks)
            if sr.needs_sample:
                logit_rows.append(len(input_ids) - 1)
        max_blocks = max(len(t) for t in tables)
        bt = torch.zeros((len(tables), max_blocks), dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=bt.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev, non_blocking=True),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            seq_lens_list=seq_lens,
            query_lens_list=q_lens,
            block_size=bs,
        )
        return (torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
                torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True), meta, logit_rows)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, rows: dict[str, SamplingRow]) -> StepResult:
        """Run the forward pass for a scheduled step and sample the requests that need a token.

        Args:
            out: the scheduler's decision for this step.
            rows: sampling settings per request id (only those with ``needs_sample``).
        """
        t0 = time.perf_counter()
        if not out.scheduled:
            return StepResult({}, {}, 0.0)
        input_ids, positions, meta, logit_rows = self.prepare_inputs(out)
        hidden = self.model(input_ids, positions, meta)
        sampled: dict[str, int] = {}
        lps: dict[str, tuple[float, list[tuple[int, float]]]] = {}
        if logit_rows:
            idx = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx))
            ids = [sr.request.request_id for sr in out.scheduled if sr.needs_sample]
            res: SamplerOutput = sample(logits, [rows[i] for i in ids])
            for rid, tok, lp in zip(ids, res.token_ids, res.logprobs):
                sampled[rid] = tok
                if lp is not None:
                    lps[rid] = lp
        return StepResult(sampled, lps, time.perf_counter() - t0)
