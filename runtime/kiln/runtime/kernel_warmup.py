"""Compile the Triton kernel variants that serving steps reach, before the first request.

Triton compiles a kernel on its first launch per specialization (the launch config a launcher
picks per M, dtypes, integer arguments equal to 1 or divisible by 16): 0.3 s (on-disk cache
hit) to several seconds each, which the request that first needs it would pay in its step
(measured: 1.9 s inside the first int4 prefill after CUDA-graph capture, Llama-3.1-8B shape,
H200, docs/benchmarks.md).  vLLM and SGLang run dummy forwards at start-up for the same reason.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

import torch

from .model.layers import LinearBase

if TYPE_CHECKING:  # pragma: no cover
    from .model_runner import ModelRunner

log = logging.getLogger(__name__)

# Token counts of the eager warm-up forwards: each side of the integer specializations Triton
# makes (== 1, % 16 == 0) and of the launch buckets (``w4a16.m_bucket``: 2, 4, 8, 16, the
# 64-row GEMV / tensor-core limits).
WARMUP_PREFILL_TOKENS = (2, 3, 5, 9, 16, 17, 31, 32, 33, 64, 65, 129)
# Linear layers run alone at every M up to this (the small-M kernels are chosen per M).
WARMUP_LINEAR_MAX_M = 64


@torch.inference_mode()
def warmup_kernels(runner: "ModelRunner", max_tokens: int | None = None, max_model_len: int | None = None,
                   max_num_seqs: int | None = None) -> list[str]:
    """Run, on CUDA (nothing elsewhere):

    * every distinct linear layer (same class, quantization, weight shapes, dtypes and
      strides) alone at M = 1 .. ``WARMUP_LINEAR_MAX_M`` and at M = 65 and ``max_tokens``;
      the LM head at M = 1 .. 9;
    * eager forwards (``warmup_steps``) of one prefill of T tokens (``WARMUP_PREFILL_TOKENS``),
      a prefill after a cached prefix, several prefills, and decodes alone and mixed with
      prefills over a ladder of contexts, with every slot -1: nothing is written to the KV
      cache, no block is taken.

    Args:
        runner: the model runner (weights loaded, KV pool allocated).
        max_tokens: the step token budget (``max_num_batched_tokens``); default 2048.
        max_model_len: longest context of a synthetic sequence (tokens); default no limit.
        max_num_seqs: most sequences in a synthetic step (steps with more cannot happen while
            serving, so their kernel variants are not compiled); default no limit.
    Returns:
        The kernel variants compiled (``"module:name"`` per compile).
    """
    if runner.device.type != "cuda":
        return []
    from kiln.kernels.launch import record_compiles  # noqa: PLC0415  (Triton: CUDA only)

    t0 = time.perf_counter()
    max_tokens = max(1, max_tokens or 2048)
    dev, dt = runner.device, runner.dtype
    with record_compiles() as compiled:
        seen = set()
        for mod in runner.model.modules():
            if not isinstance(mod, LinearBase):
                continue
            key = (type(mod).__name__, type(mod.quant_method).__name__,
                   tuple((n, tuple(t.shape), t.dtype, t.stride()) for n, t in
                         list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
                         if t is not None))
            if key in seen:
                continue
            seen.add(key)
            for m in sorted({*range(1, WARMUP_LINEAR_MAX_M + 1), 65, max_tokens}):
                mod(torch.zeros(m, mod.in_features, device=dev, dtype=dt))
        hidden = runner.model_config.hidden_size
        for m in range(1, 10):
            runner.model.compute_logits(torch.zeros(m, hidden, device=dev, dtype=dt))
        for rows in warmup_steps(max_tokens, max_model_len, max_num_seqs):
            warmup_forward(runner, rows)
    torch.cuda.synchronize()
    log.info("kernel warm-up: %d Triton kernel variants compiled (or loaded from the disk cache) in %.1fs",
             len(compiled), time.perf_counter() - t0)
    return list(compiled)


def warmup_steps(max_tokens: int, max_model_len: int | None = None,
                 max_num_seqs: int | None = None) -> list[list[tuple[int, int]]]:
    """The synthetic steps of the warm-up: per step, ``(context before the step, new tokens)``
    per sequence, decodes first, at most ``max_tokens`` new tokens, ``max_model_len`` context
    (tokens) and ``max_num_seqs`` sequences."""
    steps = [[(0, t)] for t in WARMUP_PREFILL_TOKENS]
    steps += [[(16, 17)], [(33, 16)], [(0, 17), (0, 16)], [(20, 1), (7, 9)]]
    # Decode contexts that reach each flash-decoding split count (``decode_num_splits``:
    # powers of two up to 32, at least 128 tokens per split), decodes alone (eager: no graph
    # for that batch) and mixed with prefills, 1, 2, 3, 16 and 17 sequences.
    for c in (100, 200, 300, 600, 1100, 2100, 4200, 8300):
        steps += [[(c, 1)], [(c, 1), (c // 2, 1)], [(c, 1)] * 3, [(c, 1)] * 16, [(c, 1)] * 17,
                  [(c, 1), (0, 17)], [(c, 1), (c // 2, 1), (0, 16)]]
    return [rows for rows in steps if sum(q for _, q in rows) <= max_tokens
            and (max_model_len is None or max(c + q for c, q in rows) <= max_model_len)
            and (max_num_seqs is None or len(rows) <= max_num_seqs)]


def warmup_forward(runner: "ModelRunner", rows: list[tuple[int, int]]) -> None:
    """One eager forward (and LM head) over synthetic sequences ``(context, new_tokens)`` with
    all slots -1 (no KV-cache writes); block tables point at blocks 0.. (read only)."""
    bs, nb = runner.block_size, max(1, runner.num_kv_blocks)
    seq_lens = [c + q for c, q in rows]
    q_lens = [q for _, q in rows]
    tables = [[b % nb for b in range(-(-n // bs))] for n in seq_lens]
    positions = [p for c, q in rows for p in range(c, c + q)]
    T = len(positions)
    num_decodes = 0
    while num_decodes < len(rows) and q_lens[num_decodes] == 1:
        num_decodes += 1
    meta = runner.attention_metadata([-1] * T, seq_lens, q_lens, tables, num_decodes)
    ids = torch.zeros(T, dtype=torch.int64, device=runner.device)
    hidden = runner.model(ids, runner.h2d(positions, torch.int64), meta)
    runner.model.compute_logits(hidden[torch.tensor(list(itertools.accumulate(q_lens)), device=runner.device) - 1])
